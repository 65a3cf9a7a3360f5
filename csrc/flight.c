/*
 * flight.c - the flight recorder (the last N operations of every
 * communicator) and the diagnostics log behind RINGLET_DEBUG.
 *
 * The ring is a power-of-two array of plain structs, so an op costs one
 * atomic increment, a handful of stores and the clock read at its end (the
 * start time is the one rl_begin_op already took for the deadline).  The
 * increment is atomic because a p2p comm is used by a sender and a receiver
 * thread at once.  Readers take no lock: each entry carries a generation
 * (`id + 1`, written last with release order, zeroed first on reuse), and a
 * reader keeps a copy only when the generation was the same before and after
 * copying it.  So an entry being overwritten is dropped, never torn.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

int rl_log_level = 0;

void rl_set_log_level(int level) { rl_log_level = level < 0 ? 0 : level; }

void rl_log(int level, const rl_comm *c, const char *fmt, ...) {
    if (rl_log_level < level) return;
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    /* One fprintf per line: stdio locks the stream, so lines from threads
     * (thread-mode ranks) do not interleave. */
    fprintf(stderr, "ringlet[rank %d] %s: comm %u: %s\n", c->ctx->rank,
            level >= RL_LOG_DETAIL ? "DETAIL" : "INFO", c->id, line);
}

int rl_trace_init(rl_comm *c) {
    int64_t keep = rl_tune.trace_entries;
    c->trace = NULL;
    c->trace_mask = 0;
    c->trace_keep = 0;
    c->trace_head = 0;
    if (keep <= 0) return RL_OK;
    uint64_t cap = 1;
    while (cap < (uint64_t)keep) cap <<= 1;
    c->trace = calloc(cap, sizeof *c->trace);
    if (!c->trace) return RL_ERR_NOMEM;
    c->trace_mask = cap - 1;
    c->trace_keep = (uint64_t)keep;
    return RL_OK;
}

void rl_trace_free(rl_comm *c) {
    free(c->trace);
    c->trace = NULL;
}

void rl_trace_begin(rl_comm *c, rl_opdesc *op) {
    if (!c->trace) {
        op->trace = NULL;
        return;
    }
    uint64_t id = __atomic_fetch_add(&c->trace_head, 1, __ATOMIC_RELAXED);
    rl_trace_entry *e = &c->trace[id & c->trace_mask];
    __atomic_store_n(&e->id, 0, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    e->seq = op->seq;
    e->bytes = op->total;
    e->start_ns = op->start_ns;
    e->end_ns = 0;
    e->peer = op->root;
    e->tag = 0;
    e->opcode = (uint8_t)op->opcode;
    e->dtype = (uint8_t)op->dtype;
    e->redop = (uint8_t)op->redop;
    e->flags = 0;
    e->state = RL_TRACE_STARTED;
    e->status = 0;
    e->algo = NULL;
    __atomic_store_n(&e->id, id + 1, __ATOMIC_RELEASE);
    op->trace = e;
    op->trace_id = id + 1;
}

void rl_trace_p2p(const rl_opdesc *op, int peer, uint32_t tag, int recv) {
    rl_trace_entry *e = op->trace;
    if (!e || __atomic_load_n(&e->id, __ATOMIC_RELAXED) != op->trace_id) return;
    e->peer = peer;
    e->tag = tag;
    e->flags = recv ? RL_TRACE_RECV : 0;
}

void rl_trace_end(rl_comm *c, const rl_opdesc *op, int status) {
    rl_trace_entry *e = op->trace;
    int64_t end = 0;
    if (e || rl_log_level >= RL_LOG_DETAIL) end = rl_now_ns();
    /* The ring may have wrapped past a long op: then its entry is another's. */
    if (e && __atomic_load_n(&e->id, __ATOMIC_RELAXED) == op->trace_id) {
        e->end_ns = end;
        e->status = (uint8_t)status;
        e->algo = op->algo;
        __atomic_store_n(&e->state, status == RL_OK ? RL_TRACE_COMPLETED : RL_TRACE_FAILED,
                         __ATOMIC_RELEASE);
    }
    if (rl_log_level >= RL_LOG_DETAIL)
        rl_log(RL_LOG_DETAIL, c, "%s seq=%llu bytes=%llu algorithm=%s %.1f us: %s",
               rl_opcode_name(op->opcode), (unsigned long long)op->seq,
               (unsigned long long)op->total, op->algo ? op->algo : "-",
               (end - op->start_ns) / 1e3, status == RL_OK ? "ok" : "failed");
}

size_t rl_comm_trace_capacity(const rl_comm *c) { return (size_t)c->trace_keep; }

size_t rl_comm_trace(const rl_comm *c, rl_trace_entry *out, size_t max,
                     uint64_t *total) {
    uint64_t head = __atomic_load_n(&c->trace_head, __ATOMIC_ACQUIRE);
    if (total) *total = head;
    if (!c->trace) return 0;
    uint64_t first = head > c->trace_keep ? head - c->trace_keep : 0;
    size_t n = 0;
    for (uint64_t id = first; id < head && n < max; id++) {
        const rl_trace_entry *e = &c->trace[id & c->trace_mask];
        uint64_t g = __atomic_load_n(&e->id, __ATOMIC_ACQUIRE);
        if (g != id + 1) continue; /* being written, or already reused */
        uint8_t state = __atomic_load_n(&e->state, __ATOMIC_ACQUIRE);
        memcpy(&out[n], e, sizeof *e);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&e->id, __ATOMIC_RELAXED) != g) continue;
        out[n].id = id;
        out[n].state = state;
        if (state == RL_TRACE_STARTED) out[n].end_ns = 0;
        n++;
    }
    return n;
}
