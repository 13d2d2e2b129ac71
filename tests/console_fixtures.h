/* console_fixtures.h — a test's side of kvsched.h's console socket (include after kvsched.h, kvtest.h and
 * offload_fixtures.h): connect, read its header and records, and publish the events its model keeps. */
#ifndef KVT_CONSOLE_FIXTURES_H
#define KVT_CONSOLE_FIXTURES_H
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>

/* n bytes from a socket within timeout_ms; 1 when they all came. The socket is read once more after the
 * deadline: a reader that was not scheduled until then still gets what came in time. */
static int recv_within(int fd, unsigned char *buf, size_t n, int timeout_ms)
{
    size_t got = 0;
    uint64_t end = of_now_us() + (uint64_t)timeout_ms * 1000u;
    int last = 0;
    while (got < n && !last) {
        struct pollfd p = {fd, POLLIN, 0};
        ssize_t r;
        last = of_now_us() >= end;
        if (poll(&p, 1, last ? 0 : 10) <= 0) continue;
        r = recv(fd, buf + got, n - got, MSG_DONTWAIT);
        if (r == 0) return 0;
        if (r > 0) got += (size_t)r;
    }
    return got == n;
}

static int connect_console(int fd, const char *path)
{
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    memcpy(addr.sun_path, path, strlen(path));
    return connect(fd, (struct sockaddr *)&addr, sizeof addr);
}

static void publish_slot(kvs_bus *bus, uint64_t request, uint32_t to)
{
    kvs_event e;
    memset(&e, 0, sizeof e);
    e.kind = KVS_EV_SLOT;
    e.request = request;
    e.u.slot.to = to;
    KVT_EQ(kvs_bus_publish(bus, &e), KVS_OK);
}

static void publish_release(kvs_bus *bus, uint64_t request)
{
    kvs_event e;
    memset(&e, 0, sizeof e);
    e.kind = KVS_EV_RELEASE;
    e.request = request;
    KVT_EQ(kvs_bus_publish(bus, &e), KVS_OK);
}

/* Records from a console client until none comes for quiet_ms; returns how many (at most max). */
static size_t recv_records(int fd, kvs_event *out, size_t max, int quiet_ms)
{
    unsigned char rec[KVS_RECORD_BYTES];
    size_t n = 0;
    while (n < max && recv_within(fd, rec, sizeof rec, quiet_ms)) KVT_EQ(kvs_event_decode(rec, &out[n++]), KVS_OK);
    return n;
}

#endif
