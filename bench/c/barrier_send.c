/*
 * barrier_send.c - the floor under a 2-rank small broadcast: what the kernel
 * alone costs for `barrier(); t0; one frame from rank 0 to rank 1; t1` over
 * loopback TCP, with no Python and no ringlet in the way.
 *
 * Build and run:
 *     gcc -O2 -std=gnu11 -Wall -Wextra bench/c/barrier_send.c -o /tmp/barrier_send
 *     /tmp/barrier_send [iterations] [frame bytes]      # defaults 30000, 56
 *
 * Two processes (fork) share one TCP_NODELAY connection.  Each iteration
 * both send 8 bytes and wait for the other's 8 (the barrier), take t0, and
 * then rank 0 sends one frame (56 bytes: ringlet's 48-byte header and an
 * 8-byte payload) while rank 1 receives it; each takes t1.  Times are
 * CLOCK_MONOTONIC, shared by the two processes, kept in shared memory.
 * Printed for three ways of waiting on the receiving side (the barrier's
 * receives and the frame's): retrying recv(MSG_DONTWAIT) (what ringlet's
 * spin does), spinning on poll(2) with no timeout and then receiving, and
 * blocking in poll(2).  Per wait mode: medians over the iterations (the
 * first eighth skipped) of rank 0's send, rank 1's receive from its own
 * barrier exit, and the slower of the two per iteration (what
 * `ringlet bench` reports), with its 10th and 90th percentiles.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { RECV_SPIN, POLL_SPIN, BLOCK, NMODES };
static const char *mode_name[NMODES] = {"recv spin", "poll spin", "block in poll"};

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static void die(const char *what) {
    perror(what);
    exit(1);
}

static void recv_all(int fd, char *buf, size_t len, int mode) {
    size_t got = 0;
    while (got < len) {
        struct pollfd p = {fd, POLLIN, 0};
        if (mode == POLL_SPIN)
            while (poll(&p, 1, 0) == 0) {}
        else if (mode == BLOCK && poll(&p, 1, 10000) == 0) {
            fprintf(stderr, "barrier_send: no data for 10 s\n");
            exit(1);
        }
        ssize_t n = recv(fd, buf + got, len - got, MSG_DONTWAIT);
        if (n > 0) got += (size_t)n;
        else if (n == 0) { fprintf(stderr, "barrier_send: peer closed\n"); exit(1); }
        else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) die("recv");
    }
}

static void send_all(int fd, const char *buf, size_t len) {
    size_t sent = 0;
    while (sent < len) {
        ssize_t n = send(fd, buf + sent, len - sent, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n > 0) sent += (size_t)n;
        else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) die("send");
    }
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* t[4*i + 0..3]: rank 0's t0 and t1, rank 1's t0 and t1 of iteration i. */
static void run(int mode, int iters, size_t frame, double *t) {
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    if (ls < 0) die("socket");
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t alen = sizeof a;
    if (bind(ls, (struct sockaddr *)&a, sizeof a) || listen(ls, 1) ||
        getsockname(ls, (struct sockaddr *)&a, &alen))
        die("listen");
    pid_t child = fork();
    if (child < 0) die("fork");
    int rank = child == 0 ? 1 : 0, fd;
    if (rank == 1) {
        fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a)) die("connect");
    } else if ((fd = accept(ls, NULL, NULL)) < 0) {
        die("accept");
    }
    close(ls);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    char *buf = calloc(1, frame > 8 ? frame : 8);
    if (!buf) die("calloc");
    for (int i = 0; i < iters; i++) {
        send_all(fd, buf, 8);
        recv_all(fd, buf, 8, mode);
        double t0 = now_us();
        if (rank == 0) send_all(fd, buf, frame);
        else recv_all(fd, buf, frame, mode);
        t[4 * i + 2 * rank] = t0;
        t[4 * i + 2 * rank + 1] = now_us();
    }
    free(buf);
    close(fd);
    if (rank == 1) _exit(0);
    int status;
    if (waitpid(child, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status))
        die("rank 1");
}

int main(int argc, char **argv) {
    int iters = argc > 1 ? atoi(argv[1]) : 30000;
    size_t frame = argc > 2 ? (size_t)atol(argv[2]) : 56;
    if (iters < 8 || frame == 0) {
        fprintf(stderr, "usage: barrier_send [iterations >= 8] [frame bytes > 0]\n");
        return 2;
    }
    double *t = mmap(NULL, sizeof(double) * 4 * (size_t)iters, PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    int k = iters - iters / 8;
    double *snd = malloc(sizeof(double) * (size_t)k), *rcv = malloc(sizeof(double) * (size_t)k),
           *slow = malloc(sizeof(double) * (size_t)k);
    if (t == MAP_FAILED || !snd || !rcv || !slow) die("memory");
    printf("# %d iterations, %zu-byte frame; medians in us\n", iters, frame);
    printf("# %-14s %8s %8s %8s %8s %8s\n", "wait", "send", "receive", "slower", "p10", "p90");
    for (int mode = 0; mode < NMODES; mode++) {
        run(mode, iters, frame, t);
        for (int j = 0; j < k; j++) {
            const double *x = t + 4 * (size_t)(j + iters / 8);
            snd[j] = x[1] - x[0];
            rcv[j] = x[3] - x[2];
            slow[j] = snd[j] > rcv[j] ? snd[j] : rcv[j];
        }
        qsort(snd, (size_t)k, sizeof(double), by_value);
        qsort(rcv, (size_t)k, sizeof(double), by_value);
        qsort(slow, (size_t)k, sizeof(double), by_value);
        printf("  %-14s %8.2f %8.2f %8.2f %8.2f %8.2f\n", mode_name[mode], snd[k / 2], rcv[k / 2],
               slow[k / 2], slow[k / 10], slow[9 * k / 10]);
    }
    return 0;
}
