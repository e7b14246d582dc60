/* The cold benchmark's floor in C (kvplane/bench/raw_rtt.py has the protocol and the Python
 * twin): the same two round trips per call, without an interpreter. Built by raw_rtt.py with
 * the system's cc when one is there; not part of the package's build.
 *
 *   raw_rtt serve                                   prints {"port": N}; serves until stdin closes
 *   raw_rtt client MASTER SEGS get|put N SIZE       prints {"lat": [ns, ...]}
 *
 * A request is a head of two big-endian u32 (bytes that follow, bytes to answer) and its body;
 * the answer is that many bytes. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define CAP (1 << 20)
static char scratch[CAP], reply[CAP];

static int exact(int fd, char *buf, size_t n) {
    size_t got = 0;
    while (got < n) {
        ssize_t k = recv(fd, buf + got, n - got, 0);
        if (k <= 0) return -1;
        got += (size_t)k;
    }
    return 0;
}

static int send_all(int fd, const char *buf, size_t n) {
    size_t sent = 0;
    while (sent < n) {
        ssize_t k = send(fd, buf + sent, n - sent, MSG_NOSIGNAL);
        if (k <= 0) return -1;
        sent += (size_t)k;
    }
    return 0;
}

static void nodelay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static void serve_conn(int c) {
    uint32_t head[2];
    nodelay(c);
    for (;;) {
        if (exact(c, (char *)head, sizeof head)) break;
        uint32_t body = ntohl(head[0]), answer = ntohl(head[1]);
        if (body > CAP || answer > CAP) break;
        if (body && exact(c, scratch, body)) break;
        if (send_all(c, reply, answer)) break;
    }
    close(c);
}

static int serve(void) {
    struct sockaddr_in a = {0};
    socklen_t len = sizeof a;
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (ls < 0 || bind(ls, (struct sockaddr *)&a, sizeof a) || listen(ls, 16) ||
        getsockname(ls, (struct sockaddr *)&a, &len))
        return 1;
    printf("{\"port\": %d}\n", ntohs(a.sin_port));
    fflush(stdout);
    for (;;) { /* one connection at a time: the benchmark's client connects once per run */
        struct pollfd p[2] = {{ls, POLLIN, 0}, {0, POLLIN, 0}};
        if (poll(p, 2, -1) < 0) return 1;
        if (p[1].revents) {
            char b[64];
            if (read(0, b, sizeof b) <= 0) return 0; /* the parent closed stdin */
        }
        if (p[0].revents & POLLIN) {
            int c = accept(ls, NULL, NULL);
            if (c >= 0) serve_conn(c);
        }
    }
}

static int connect_to(int port) {
    struct sockaddr_in a = {0};
    int s = socket(AF_INET, SOCK_STREAM, 0);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons((uint16_t)port);
    if (s < 0 || connect(s, (struct sockaddr *)&a, sizeof a)) return -1;
    nodelay(s);
    return s;
}

static int round_trip(int fd, uint32_t body, uint32_t answer) {
    uint32_t head[2] = {htonl(body), htonl(answer)};
    if (send_all(fd, (char *)head, sizeof head) || (body && send_all(fd, reply, body))) return -1;
    return exact(fd, scratch, answer);
}

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static int client(int master_port, char *segs, int put, long n, uint32_t size) {
    int fds[1024], nseg = 0, master = connect_to(master_port);
    for (char *tok = strtok(segs, ","); tok && nseg < 1024; tok = strtok(NULL, ","))
        if ((fds[nseg++] = connect_to(atoi(tok))) < 0) return 1;
    if (master < 0 || nseg == 0 || size > CAP) return 1;
    printf("{\"lat\": [");
    for (long i = 0; i < n; i++) {
        int seg = fds[i % nseg];
        long t = now_ns();
        int bad = put ? round_trip(seg, size, 8) || round_trip(master, 32, 64)
                      : round_trip(master, 32, 64) || round_trip(seg, 32, size);
        if (bad) return 1;
        printf("%s%ld", i ? ", " : "", now_ns() - t);
    }
    printf("]}\n");
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 2 && !strcmp(argv[1], "serve")) return serve();
    if (argc == 7 && !strcmp(argv[1], "client"))
        return client(atoi(argv[2]), argv[3], !strcmp(argv[4], "put"), atol(argv[5]),
                      (uint32_t)atol(argv[6]));
    fprintf(stderr, "usage: raw_rtt serve | client MASTER SEGS get|put N SIZE\n");
    return 2;
}
