/*
 * ucx_tag_stream: a tagged-message stream between two processes written directly against UCX, with nothing
 * of longctx in it: a second peer for the UCX rows of `longctx-p2p-bench` (the first is `ucx_perftest`), run by hand:
 * what a plain UCX program reaches with the same transports, sizes and windows.
 *
 *   cc -O2 -o /tmp/ucx_tag_stream bench/ucx_tag_stream.c $(pkg-config --cflags --libs ucx)
 *   UCX_TLS=tcp,self /tmp/ucx_tag_stream SIZE SEND_WINDOW RECV_WINDOW ITERS
 *
 * The process forks; the parent (rank 0) sends, the child (rank 1) receives. The sender keeps SEND_WINDOW
 * `ucp_tag_send_nbx` in flight (a sliding window), the receiver RECV_WINDOW `ucp_tag_recv_nbx` (each into its
 * own buffer). Single-threaded workers polled with `ucp_worker_progress` in a tight loop, `UCP_FEATURE_TAG`
 * only, as `ucx_perftest` sets them up. One full pass warms up; the second is timed, and each rank prints its
 * rate in GiB/s (2^30 bytes). Worker addresses are exchanged over a socketpair made before the fork.
 */
#include <ucp/api/ucp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>

static ucp_worker_h worker;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void read_all(int fd, void *p, size_t n)
{
    char *c = p;
    while (n) {
        ssize_t k = read(fd, c, n);
        if (k <= 0) { perror("read"); exit(3); }
        c += k;
        n -= (size_t)k;
    }
}

static void write_all(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n) {
        ssize_t k = write(fd, c, n);
        if (k <= 0) { perror("write"); exit(3); }
        c += k;
        n -= (size_t)k;
    }
}

/* Progresses the worker until the request (NULL: finished at once) completes, then frees it. */
static void wait_request(void *r)
{
    if (r == NULL) return;
    if (UCS_PTR_IS_ERR(r)) { fprintf(stderr, "operation failed: %s\n", ucs_status_string(UCS_PTR_STATUS(r))); exit(4); }
    while (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_worker_progress(worker);
    ucp_request_free(r);
}

static void barrier(int fd)
{
    char b = 0;
    write_all(fd, &b, 1);
    read_all(fd, &b, 1);
}

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: %s SIZE SEND_WINDOW RECV_WINDOW ITERS\n", argv[0]);
        return 2;
    }
    size_t size = strtoull(argv[1], NULL, 10);
    int send_window = atoi(argv[2]), recv_window = atoi(argv[3]), iters = atoi(argv[4]);
    if (send_window < 1 || recv_window < 1 || iters < 1) return 2;
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) { perror("socketpair"); return 1; }
    pid_t pid = fork();
    if (pid < 0) { perror("fork"); return 1; }
    int rank = pid == 0 ? 1 : 0, fd = sv[rank];

    ucp_params_t params = { .field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_TAG };
    ucp_config_t *config;
    ucp_context_h context;
    if (ucp_config_read(NULL, NULL, &config) != UCS_OK) return 1;
    if (ucp_init(&params, config, &context) != UCS_OK) return 1;
    ucp_config_release(config);
    ucp_worker_params_t wparams = { .field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                                    .thread_mode = UCS_THREAD_MODE_SINGLE };
    if (ucp_worker_create(context, &wparams, &worker) != UCS_OK) return 1;

    ucp_address_t *address;
    size_t address_len, peer_len;
    if (ucp_worker_get_address(worker, &address, &address_len) != UCS_OK) return 1;
    write_all(fd, &address_len, sizeof address_len);
    write_all(fd, address, address_len);
    read_all(fd, &peer_len, sizeof peer_len);
    void *peer = malloc(peer_len);
    read_all(fd, peer, peer_len);
    ucp_ep_params_t eparams = { .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS, .address = peer };
    ucp_ep_h ep;
    if (ucp_ep_create(worker, &eparams, &ep) != UCS_OK) return 1;

    int buffers = rank == 1 ? recv_window : 1;
    char *buf = malloc(size * (size_t)buffers);
    void **requests = calloc((size_t)iters, sizeof(void *));
    if (buf == NULL || requests == NULL) return 1;
    memset(buf, rank + 1, size * (size_t)buffers);
    ucp_request_param_t rparams = { 0 };
    int window = rank == 0 ? send_window : recv_window;

    for (int pass = 0; pass < 2; pass++) {
        barrier(fd);
        double t0 = now();
        int oldest = 0;
        for (int i = 0; i < iters; i++) {
            if (i - oldest >= window) wait_request(requests[oldest++]);
            if (rank == 0)
                requests[i] = ucp_tag_send_nbx(ep, buf, size, 7, &rparams);
            else
                requests[i] = ucp_tag_recv_nbx(worker, buf + (size_t)(i % buffers) * size, size, 7,
                                               (ucp_tag_t)-1, &rparams);
        }
        while (oldest < iters) wait_request(requests[oldest++]);
        double t = now() - t0;
        if (pass == 1)
            printf("rank %d (%s) size %zu send window %d recv window %d: %.2f GiB/s\n", rank,
                   rank == 0 ? "sender" : "receiver", size, send_window, recv_window,
                   (double)size * iters / t / (double)(1u << 30));
    }
    barrier(fd);
    if (rank == 0) waitpid(pid, NULL, 0);
    return 0;
}
