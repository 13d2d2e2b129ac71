/* Out of memory on kvsched.h's observation side: kvs_bus_subscribe, kvs_reader_open, kvs_bus_break_add
 * and kvs_log_read. Every allocation a call makes (KVB_MALLOC and KVB_REALLOC) is made to fail in turn,
 * once or from then on, for N = 0, 1, .. until the call makes no Nth: the call returns KVS_ENOMEM with
 * the bus and the caller's out parameters as they were (no subscriber, reader or breakpoint more, no id
 * used up, no events handed out), or succeeds. Before, a bus whose array of subscribers, readers or
 * breakpoints had to grow crashed in stb_ds's growth, and so did a log read. The console's list of live
 * slots out of memory forgets them (before, it crashed too). (Leaks show at exit under AddressSanitizer.) */
#include "oom_hooks.h"
#define KVBLOCK_IMPLEMENTATION
#define KVOFFLOAD_IMPLEMENTATION
#define KVSCHED_IMPLEMENTATION
#include "kvsched.h"
#include "kvtest.h"
#include "offload_fixtures.h"
#include "console_fixtures.h"

#include <sys/stat.h>
#include <unistd.h>

enum { MANY = 40, LOGGED = 300 };

static kvs_bus *new_bus(void)
{
    kvs_bus *bus = NULL;
    KVT_EQ(kvs_bus_create(NULL, &bus), KVS_OK);
    return bus;
}

static void publish_step(kvs_bus *bus)
{
    kvs_event e;
    memset(&e, 0, sizeof e);
    e.kind = KVS_EV_STEP;
    KVT_EQ(kvs_bus_publish(bus, &e), KVS_OK);
}

static void count_call(void *user, const kvs_event *e)
{
    (void)e;
    (*(int *)user)++;
}

/* MANY subscribers, each added with every allocation failing in turn: one publish reaches exactly the
 * ones added. */
static void test_subscribe_out_of_memory(void)
{
    kvs_bus *bus = new_bus();
    int calls = 0, added = 0, failed = 0;
    for (int i = 0; bus && i < MANY; i++)
        for (long at = 0;; at++) {
            uint32_t id = 777;
            kvs_result r;
            oom_arm(at, at & 1);
            r = kvs_bus_subscribe(bus, 0, count_call, &calls, &id);
            oom_disarm();
            if (r == KVS_ENOMEM) {
                failed++;
                KVT_EQ(id, 777);
            } else {
                KVT_EQ(r, KVS_OK);
                added++;
            }
            calls = 0;
            publish_step(bus);
            KVT_EQ(calls, added);
            if (r == KVS_OK) break;
        }
    KVT_EQ(added, MANY);
    KVT_CHECK(failed > 0); /* the array grew at least once */
    kvs_bus_destroy(bus);
}

/* MANY readers, each opened the same way: a failed open hands out nothing and frees what it took; every
 * reader opened gets each event published after it. */
static void test_reader_open_out_of_memory(void)
{
    kvs_bus *bus = new_bus();
    kvs_reader *readers[MANY];
    int n = 0, failed = 0;
    for (int i = 0; bus && i < MANY; i++)
        for (long at = 0;; at++) {
            kvs_reader *got = (kvs_reader *)&n; /* a sentinel: must stay */
            kvs_result r;
            oom_arm(at, at & 1);
            r = kvs_reader_open(bus, 0, 8, &got);
            oom_disarm();
            if (r == KVS_ENOMEM) {
                failed++;
                KVT_CHECK(got == (kvs_reader *)&n);
                continue;
            }
            KVT_EQ(r, KVS_OK);
            readers[n++] = got;
            break;
        }
    KVT_EQ(n, MANY);
    KVT_CHECK(failed >= 2 * MANY); /* the reader and its ring, every time; the array now and then */
    publish_step(bus);
    for (int i = 0; i < n; i++) {
        kvs_event e;
        size_t got = 0;
        uint64_t lost = 1;
        KVT_EQ(kvs_reader_read(readers[i], &e, 1, &got, &lost), KVS_OK);
        KVT_EQ(got, 1);
        KVT_EQ(lost, 0);
        KVT_EQ(e.kind, KVS_EV_STEP);
        kvs_reader_close(readers[i]);
    }
    kvs_bus_destroy(bus);
}

/* MANY breakpoints: a failed add uses no id, so the ids of those added run 1, 2, 3, ..; each one added
 * can be removed, once. */
static void test_break_add_out_of_memory(void)
{
    kvs_bus *bus = new_bus();
    uint32_t ids[MANY], last = 0;
    int n = 0, failed = 0;
    kvs_breakpoint bp;
    memset(&bp, 0, sizeof bp);
    bp.request = 12345;
    for (int i = 0; bus && i < MANY; i++)
        for (long at = 0;; at++) {
            uint32_t id = 777;
            kvs_result r;
            oom_arm(at, at & 1);
            r = kvs_bus_break_add(bus, &bp, &id);
            oom_disarm();
            if (r == KVS_ENOMEM) {
                failed++;
                KVT_EQ(id, 777);
                continue;
            }
            KVT_EQ(r, KVS_OK);
            if (n) KVT_EQ(id, last + 1);
            ids[n++] = last = id;
            break;
        }
    KVT_EQ(n, MANY);
    KVT_CHECK(failed > 0);
    for (int i = 0; i < n; i++) KVT_EQ(kvs_bus_break_remove(bus, ids[i]), KVS_OK);
    for (int i = 0; i < n; i++) KVT_EQ(kvs_bus_break_remove(bus, ids[i]), KVS_ENOTFOUND);
    kvs_bus_destroy(bus);
}

/* A temporary log (its name in path) that a recorder wrote LOGGED events to; 0 when it cannot be made. */
static int make_log(kvs_bus *bus, char *path, size_t size)
{
    kvs_recorder *rec = NULL;
    kvs_recorder_config rc;
    int fd;
    snprintf(path, size, "/tmp/kvobs-oom-XXXXXX");
    fd = mkstemp(path);
    KVT_CHECK(fd >= 0);
    if (fd < 0 || !bus) return 0;
    close(fd);
    memset(&rc, 0, sizeof rc);
    rc.log_path = path;
    KVT_EQ(kvs_recorder_create(bus, &rc, &rec), KVS_OK);
    for (int i = 0; i < LOGGED; i++) publish_step(bus);
    kvs_recorder_destroy(rec);
    return rec != NULL;
}

/* A log of LOGGED events read with every allocation failing in turn: KVS_ENOMEM leaves *out and *out_n
 * as they were; a read that succeeds returns every event. */
static void test_log_read_out_of_memory(void)
{
    char path[64];
    kvs_bus *bus = new_bus();
    int failed = 0, read_whole = 0;
    if (!make_log(bus, path, sizeof path)) return;
    for (int sticky = 0; sticky < 2; sticky++)
        for (long at = 0;; at++) {
            kvs_event *out = (kvs_event *)path; /* sentinels: must stay */
            size_t n = 777;
            kvs_log_report rep;
            kvs_result r;
            int fired;
            oom_arm(at, sticky);
            r = kvs_log_read(path, &out, &n, &rep);
            fired = oom_fired;
            oom_disarm();
            if (r == KVS_ENOMEM) {
                failed++;
                KVT_CHECK(out == (kvs_event *)path);
                KVT_EQ(n, 777);
            } else {
                KVT_EQ(r, KVS_OK);
                KVT_EQ(n, LOGGED);
                KVT_EQ(rep.records, LOGGED);
                KVT_EQ(out[LOGGED - 1].kind, KVS_EV_STEP);
                kvs_log_free(out);
                read_whole++;
            }
            if (!fired) break;
        }
    KVT_CHECK(failed > 2); /* the events' array grows a few times, then the copy */
    KVT_EQ(read_whole, 2);  /* the last one of each sweep, with the memory there */
    unlink(path);
    kvs_bus_destroy(bus);
}

/* A recorder created over an existing log with every allocation failing in turn: KVS_ENOMEM leaves the
 * log as it was (the room for the subscription is made before the file is truncated). Before, the log
 * was emptied and then the subscription failed. */
static void test_recorder_create_out_of_memory(void)
{
    char path[64];
    kvs_bus *bus = new_bus();
    kvs_recorder *rec = NULL;
    kvs_recorder_config rc;
    struct stat st;
    off_t full;
    int refused = 0;
    if (!make_log(bus, path, sizeof path)) return;
    memset(&rc, 0, sizeof rc);
    rc.log_path = path;
    KVT_EQ(stat(path, &st), 0);
    full = st.st_size;
    static int others;
    for (int more = 0; more < MANY; more++) { /* one subscriber more each time: the array is full now and then */
        KVT_EQ(kvs_bus_subscribe(bus, 0, count_call, &others, NULL), KVS_OK);
        for (long at = 0;; at++) {
            kvs_result r;
            int fired;
            rec = NULL;
            oom_arm(at, 1);
            r = kvs_recorder_create(bus, &rc, &rec);
            fired = oom_fired;
            oom_disarm();
            if (r == KVS_OK) {
                kvs_recorder_destroy(rec); /* an empty log now: written again for the next try */
                KVT_EQ(kvs_recorder_create(bus, &rc, &rec), KVS_OK);
                for (int i = 0; i < LOGGED; i++) publish_step(bus);
                kvs_recorder_destroy(rec);
            } else {
                KVT_EQ(r, KVS_ENOMEM);
                KVT_CHECK(rec == NULL);
                refused++;
            }
            KVT_EQ(stat(path, &st), 0);
            KVT_EQ(st.st_size, full);
            if (!fired) break;
        }
    }
    KVT_CHECK(refused >= 2);
    unlink(path);
    kvs_bus_destroy(bus);
}

/* The console thread's allocations fail in turn, one at a time, while requests change slots (the console
 * notes each in its list of live slots, which then has to grow): it keeps serving. With the memory back,
 * a client that attaches gets every live slot noted since, each once, and none released. */
static void test_console_live_slots_out_of_memory(void)
{
    enum { ROUNDS = 12, PER = 8 };
    kvs_bus *bus = new_bus();
    kvs_console *con = NULL;
    kvs_console_config cc;
    char path[64];
    unsigned char header[KVS_LOG_HEADER_BYTES];
    static kvs_event got[4 * ROUNDS * PER];
    int seen[ROUNDS * PER + 8];
    uint64_t r = 1;
    size_t published = 0, n, live, i;
    int a, b;
    snprintf(path, sizeof path, "/tmp/kvs_oom_console_%d.sock", (int)getpid());
    memset(&cc, 0, sizeof cc);
    cc.path = path;
    KVT_EQ(kvs_console_start(bus, &cc, &con), KVS_OK);
    if (!con) return;
    for (long at = 0; at < ROUNDS; at++) {
        oom_arm(at, 0);
        for (i = 0; i < PER; i++, published++) publish_slot(bus, r++, 1);
        of_sleep_us(120000); /* the console polls at least every 50 ms */
        oom_disarm();
    }
    publish_slot(bus, r++, 2), published++;
    publish_slot(bus, r++, KVS_SLOT_FINISHED), published++;
    publish_release(bus, r - 1), published++;
    a = socket(AF_UNIX, SOCK_STREAM, 0); /* attached once the console has noted all of them */
    KVT_EQ(connect_console(a, path), 0);
    KVT_CHECK(recv_within(a, header, sizeof header, 5000));
    publish_slot(bus, r, 3), published++;
    KVT_EQ(recv_records(a, got, sizeof got / sizeof got[0], 2000) >= 1, 1);
    b = socket(AF_UNIX, SOCK_STREAM, 0);
    KVT_EQ(connect_console(b, path), 0);
    KVT_CHECK(recv_within(b, header, sizeof header, 5000));
    n = recv_records(b, got, sizeof got / sizeof got[0], 300);
    KVT_CHECK(n >= published + 2); /* the history, and at least the two slots noted with the memory there */
    live = n - published;
    memset(seen, 0, sizeof seen);
    for (i = 0; i < live; i++) {
        KVT_EQ(got[i].kind, KVS_EV_SLOT);
        KVT_CHECK(got[i].request >= 1 && got[i].request <= r && got[i].request != r - 1);
        if (got[i].request < 1 || got[i].request > r) continue;
        KVT_EQ(seen[got[i].request]++, 0);
    }
    KVT_EQ(seen[r - 2], 1);
    KVT_EQ(seen[r], 1);
    close(a);
    close(b);
    kvs_console_stop(con);
    kvs_bus_destroy(bus);
}

int main(void)
{
    KVT_RUN(test_subscribe_out_of_memory);
    KVT_RUN(test_reader_open_out_of_memory);
    KVT_RUN(test_break_add_out_of_memory);
    KVT_RUN(test_log_read_out_of_memory);
    KVT_RUN(test_recorder_create_out_of_memory);
    KVT_RUN(test_console_live_slots_out_of_memory);
    return kvt_summary();
}
