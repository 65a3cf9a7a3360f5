"""``ringlet.nn.tensor_parallel``: old import path of ``ringlet.parallel.tensor_parallel``, kept working."""

from ..parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                        SequenceParallelGather, SequenceParallelScatter,
                                        VocabParallelEmbedding, gather_from_sequence_parallel,
                                        mark_sequence_parallel, scatter_to_sequence_parallel,
                                        vocab_parallel_cross_entropy)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "SequenceParallelScatter", "SequenceParallelGather",
           "scatter_to_sequence_parallel", "gather_from_sequence_parallel",
           "mark_sequence_parallel"]
