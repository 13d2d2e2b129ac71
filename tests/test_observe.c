/* Observability of kvsched.h (section 8): events, the bus and its readers, the recorder and its log
 * file, replay, hooks and breakpoints, Prometheus metrics.
 *
 * - Every event kind survives the binary form (80 bytes + CRC-32C) and the JSON form unchanged; the
 *   JSON names kinds, slot states and transfer stages in words; damage, short buffers and garbage are
 *   reported, not parsed.
 * - A reader that is never read does not hold publishing back: it keeps the newest events and counts
 *   the rest as lost; callbacks see everything; kind masks filter; seq counts from 1 without gaps.
 * - The recorder's log file reads back as recorded; a cut-short or corrupted file gives back the records
 *   before the damage and says where it is; a missing or foreign file is an I/O error, and so is a read
 *   that fails part way (nothing is returned).
 * - A recorded run with preemption and device prefix hits replays identically into a fresh scheduler
 *   (from memory and from the log file); a different budget is reported at the first differing decision.
 * - Breakpoints and pauses stop the engine thread where they say and hold it until resumed; hooks see
 *   every entry point twice (will / finished).
 * - kvs_metrics_write is valid Prometheus text exposition (checked line by line here) whose numbers are
 *   the scheduler's and the pool's; the text is whole, of the length said, when counters move meanwhile.
 * - The console drops an overlong command line whole; out of file descriptors it does not spin, keeps
 *   serving its clients, and accepts the waiting one once descriptors are free; under a flood of events
 *   it still takes commands and clients, and stops within its second of flushing.
 * - NULL arguments are KVS_EINVAL everywhere. */
#define KVBLOCK_IMPLEMENTATION
#define KVOFFLOAD_IMPLEMENTATION
#define KVSCHED_IMPLEMENTATION
/* kvs_metrics_write's seam between its measuring and its writing pass: counters move there, as another
 * thread could move them (metrics_text_is_whole_when_a_counter_gains_a_digit) */
static void metrics_between_passes(void);
#define KVS__METRICS_BETWEEN_PASSES(sched) metrics_between_passes()
/* kvs_log_read's seam between two records: from there on the file's reads fail
 * (read_error_in_the_middle_of_a_log_is_an_io_error) */
#include <stdio.h>
static void log_between_records(FILE *f);
#define KVS__LOG_BETWEEN_RECORDS(f) log_between_records(f)
#include "kvsched.h"
#include "kvtest.h"
#include "sched_fixtures.h"
#include "console_fixtures.h"
#include <ctype.h>
#include <fcntl.h>
#include <math.h>
#include <stdatomic.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

/* ---- helpers ------------------------------------------------------------------------------------------ */

static int events_equal(const kvs_event *a, const kvs_event *b) { return memcmp(a, b, sizeof *a) == 0; }

/* On a mismatch, the first differing byte offset of two events (for the failure message). */
static void explain_diff(const char *what, const kvs_event *want, const kvs_event *got)
{
    const unsigned char *x = (const unsigned char *)want, *y = (const unsigned char *)got;
    for (size_t i = 0; i < sizeof *want; i++)
        if (x[i] != y[i]) {
            fprintf(stderr, "  %s: kind %u (%s): first difference at byte %zu: want 0x%02x got 0x%02x\n", what,
                    (unsigned)want->kind, kvs_event_kind_name((kvs_event_kind)want->kind), i, x[i], y[i]);
            return;
        }
}

static uint32_t crc32c(const unsigned char *p, size_t n)
{
    uint32_t crc = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {
        crc ^= p[i];
        for (int k = 0; k < 8; k++) crc = (crc >> 1) ^ (0x82f63b78u & (0u - (crc & 1u)));
    }
    return ~crc;
}

static uint32_t le32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void put_le32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}

static int little_endian_host(void)
{
    const uint16_t one = 1;
    return *(const unsigned char *)&one == 1;
}

/* An event of `kind` with every field its kind uses set to something other than zero. */
static kvs_event sample_event(kvs_event_kind kind)
{
    static const kvb_hash h = {0x9e3779b97f4a7c15ull, 0xc4ceb9fe1a85ec53ull}, parent = {0xff51afd7ed558ccdull, 1};
    kvs_event e;
    memset(&e, 0, sizeof e);
    e.seq = 1000 + (uint64_t)kind;
    e.time_ns = 1700000000123456789ull + (uint64_t)kind;
    e.request = 42;
    e.kind = (uint16_t)kind;
    e.version = KVS_EVENT_VERSION;
    switch (kind) {
    case KVS_EV_SLOT:
        e.u.slot.from = KVS_SLOT_PREFILLING;
        e.u.slot.to = KVS_SLOT_DECODING;
        e.u.slot.tokens = 300;
        e.u.slot.computed = 299;
        break;
    case KVS_EV_ADMIT:
        e.u.admit.prompt_tokens = 257;
        e.u.admit.device_hit_tokens = 128;
        e.u.admit.lower_hit_tokens = 64;
        e.u.admit.priority = -3;
        e.u.admit.preemptions = 2;
        break;
    case KVS_EV_STEP:
        e.request = 0;
        e.u.step.step = 77;
        e.u.step.prefill = 3;
        e.u.step.decode = 12;
        e.u.step.tokens = 812;
        e.u.step.preempted = 1;
        e.u.step.waiting = 5;
        e.u.step.running = 15;
        e.u.step.swapped = 2;
        e.u.step.onboarding = 1;
        e.u.step.device_used = 900;
        e.u.step.device_blocks = 1024;
        break;
    case KVS_EV_BLOCK_STORED:
    case KVS_EV_BLOCK_REMOVED:
        e.request = 0;
        e.u.block.tier = 1;
        e.u.block.tokens = 16;
        e.u.block.hash = h;
        e.u.block.parent = parent;
        break;
    case KVS_EV_BLOCK_CLEARED: /* kvb_event: no tokens, no hash */
        e.request = 0;
        e.u.block.tier = 2;
        break;
    case KVS_EV_TRANSFER:
        e.request = 0;
        e.u.transfer.transfer = 0x100000002ull;
        e.u.transfer.stage = KVS_XFER_FAILED;
        e.u.transfer.src_tier = 1;
        e.u.transfer.dst_tier = 0;
        e.u.transfer.blocks = 8;
        e.u.transfer.moved = 6;
        e.u.transfer.error = -105;
        e.u.transfer.onboard = 1;
        break;
    case KVS_EV_TIERS:
        e.request = 0;
        e.u.tiers.num_tiers = 3;
        e.u.tiers.used[0] = 900;
        e.u.tiers.used[1] = 2000;
        e.u.tiers.used[2] = 5000;
        e.u.tiers.total[0] = 1024;
        e.u.tiers.total[1] = 4096;
        e.u.tiers.total[2] = 100000;
        e.u.tiers.policies = (uint32_t)KVB_EVICT_FOL | (uint32_t)KVB_EVICT_LRU << 8 | (uint32_t)KVB_EVICT_ARC << 16;
        e.u.tiers.device_step = 5000;
        e.u.tiers.device_tails = 1;
        break;
    case KVS_EV_ADD:
        e.u.add.num_prompt = 300;
        e.u.add.salt = 0xdeadbeefcafef00dull;
        e.u.add.max_new_tokens = 64;
        e.u.add.priority = -2;
        e.u.add.num_extra = 1;
        break;
    case KVS_EV_TOKENS:
        e.u.tokens.n = 11;
        for (uint32_t i = 0; i < 11; i++) e.u.tokens.words[i] = 0xfffffff0u - i * 0x01010101u;
        break;
    case KVS_EV_RUN_STEP: e.u.run.step = 78; break;
    case KVS_EV_COMPLETE: e.u.run.step = 77; break;
    case KVS_EV_APPEND: e.u.append.n = 3; break;
    case KVS_EV_FINISH:
    case KVS_EV_ABORT:
    case KVS_EV_RELEASE: break;
    case KVS_EV_PAUSED:
        e.u.pause.call = KVS_CALL_STEP;
        e.u.pause.finished = 1;
        break;
    case KVS_EV_RESUMED: e.u.pause.state = KVS_SLOT_DECODING; break;
    default: break;
    }
    return e;
}

static int make_temp(char *path, size_t size)
{
    int fd;
    snprintf(path, size, "/tmp/kvobs-XXXXXX");
    fd = mkstemp(path);
    if (fd < 0) return 0;
    close(fd);
    return 1;
}

static int write_file(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    int ok;
    if (!f) return 0;
    ok = fwrite(data, 1, n, f) == n;
    return fclose(f) == 0 && ok;
}

/* The whole file in a malloc'd buffer (NULL on failure). */
static unsigned char *read_file(const char *path, size_t *out_n)
{
    FILE *f = fopen(path, "rb");
    unsigned char *buf = NULL;
    long n;
    if (!f) return NULL;
    if (fseek(f, 0, SEEK_END) == 0 && (n = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0) {
        buf = (unsigned char *)malloc((size_t)n + 1);
        if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
            free(buf);
            buf = NULL;
        }
        *out_n = (size_t)n;
    }
    fclose(f);
    return buf;
}

/* ---- an environment: metadata-only device pool, bus, scheduler ---------------------------------------- */

typedef struct obs_env {
    kvb_pool *dev;
    kvs_bus *bus;
    kvs_sched *s;
} obs_env;

/* bus may be NULL (no events). max_tokens 0 = the default budget. */
static void obs_open(obs_env *e, uint32_t device_blocks, uint32_t max_tokens, kvs_bus *bus)
{
    kvs_sched_config sc;
    memset(e, 0, sizeof *e);
    e->bus = bus;
    e->dev = of_meta_pool(device_blocks);
    memset(&sc, 0, sizeof sc);
    sc.device = e->dev;
    sc.max_tokens = max_tokens;
    sc.bus = bus;
    KVT_EQ(kvs_sched_create(&sc, &e->s), KVS_OK);
}

static void obs_close(obs_env *e)
{
    kvs_sched_destroy(e->s);
    kvb_pool_destroy(e->dev);
    memset(e, 0, sizeof *e);
}

static kvs_bus *new_bus(void)
{
    kvs_bus *bus = NULL;
    KVT_EQ(kvs_bus_create(NULL, &bus), KVS_OK);
    return bus;
}

/* A refused add publishes nothing: its event named the id the next add takes, so two adds of one
 * request went out. */
static void refused_add_publishes_nothing(void)
{
    obs_env e;
    kvs_reader *adds = NULL;
    kvs_event got[4];
    size_t n = 0;
    uint64_t lost = 0, id = 0;
    uint32_t prompt[100];
    for (uint32_t i = 0; i < 100; i++) prompt[i] = i;
    obs_open(&e, 4, 0, new_bus()); /* 4 blocks of 16 tokens */
    KVT_EQ(kvs_reader_open(e.bus, KVS_EV_MASK(KVS_EV_ADD), 4, &adds), KVS_OK);
    kvs_request rq;
    memset(&rq, 0, sizeof rq);
    rq.prompt = prompt;
    rq.num_prompt = 100;
    KVT_EQ(kvs_sched_add(e.s, &rq, &id), KVS_ETOOBIG);
    KVT_EQ(kvs_reader_read(adds, got, 4, &n, &lost), KVS_OK);
    KVT_EQ(n, 0);
    rq.num_prompt = 20;
    KVT_EQ(kvs_sched_add(e.s, &rq, &id), KVS_OK);
    KVT_EQ(kvs_reader_read(adds, got, 4, &n, &lost), KVS_OK);
    KVT_EQ(n, 1);
    if (n == 1) KVT_EQ(got[0].request, id);
    kvs_reader_close(adds);
    kvs_bus *bus = e.bus;
    obs_close(&e);
    kvs_bus_destroy(bus);
}

/* An append of no tokens may pass NULL for them (n = 0 is allowed with tokens NULL): recorded, its
 * event carries no words, and nothing reads through the NULL pointer. */
static void empty_append_with_null_tokens_is_recorded(void)
{
    obs_env e;
    kvs_reader *appends = NULL;
    kvs_event got[4];
    kvs_step st;
    size_t n = 0;
    uint64_t lost = 0, id = 0;
    uint32_t prompt[20];
    for (uint32_t i = 0; i < 20; i++) prompt[i] = i;
    obs_open(&e, 4, 0, new_bus());
    KVT_EQ(kvs_reader_open(e.bus, KVS_EV_MASK(KVS_EV_APPEND) | KVS_EV_MASK(KVS_EV_TOKENS), 4, &appends), KVS_OK);
    kvs_request rq;
    memset(&rq, 0, sizeof rq);
    rq.prompt = prompt;
    rq.num_prompt = 20;
    KVT_EQ(kvs_sched_add(e.s, &rq, &id), KVS_OK);
    KVT_EQ(kvs_sched_step(e.s, &st), KVS_OK);
    KVT_EQ(kvs_sched_complete(e.s, &st), KVS_OK);
    KVT_EQ(kvs_sched_append(e.s, id, NULL, 0), KVS_OK);
    KVT_EQ(kvs_reader_read(appends, got, 4, &n, &lost), KVS_OK);
    KVT_EQ(n, 1);
    if (n == 1) {
        KVT_EQ(got[0].kind, KVS_EV_APPEND);
        KVT_EQ(got[0].u.append.n, 0);
    }
    kvs_reader_close(appends);
    kvs_bus *bus = e.bus;
    obs_close(&e);
    kvs_bus_destroy(bus);
}

/* ---- the recorded workload ------------------------------------------------------------------------------
 * 30 requests arriving every other step into a 24-block (384-token) device: two in three share one of
 * three 32-token prefixes (device hits once the first of them has computed it), priorities 0..2 (later,
 * higher ones preempt running lower ones; growing decodes preempt too), every fifth runs until the engine
 * finishes it, three are aborted (decoding, just added, early), every finished one is released.
 * Deterministic from its seed. */

enum { WL_REQUESTS = 30, WL_DEVICE_BLOCKS = 24, WL_MAX_STEPS = 3000 };

typedef struct wl_result {
    size_t steps, adds, appends, finishes, aborts, releases;
    int idle;
} wl_result;

static void wl_prompt(uint64_t seed, int i, uint64_t *rng, uint32_t *out, size_t *n)
{
    if (i % 3 != 2) {
        size_t tail = 8 + (size_t)(sf_rand(rng) % 40);
        sf_tokens(seed * 100 + (uint64_t)(i % 3), out, 32); /* the shared prefix */
        sf_tokens(seed * 100 + 10 + (uint64_t)i, out + 32, tail);
        *n = 32 + tail;
    } else {
        *n = 20 + (size_t)(sf_rand(rng) % 60);
        sf_tokens(seed * 100 + 10 + (uint64_t)i, out, *n);
    }
}

static wl_result run_workload(kvs_sched *s, uint64_t seed)
{
    wl_result res;
    uint64_t ids[WL_REQUESTS] = {0}, rng = seed * 2654435761u + 1;
    int live[WL_REQUESTS] = {0}, open_ended[WL_REQUESTS] = {0};
    int added = 0;
    memset(&res, 0, sizeof res);
    for (size_t step = 0; step < WL_MAX_STEPS; step++) {
        kvs_step st;
        if (added < WL_REQUESTS && step % 2 == 0) {
            uint32_t prompt[128];
            kvs_request rq;
            memset(&rq, 0, sizeof rq);
            wl_prompt(seed, added, &rng, prompt, &rq.num_prompt);
            rq.prompt = prompt;
            open_ended[added] = added % 5 == 4;
            rq.max_new_tokens = open_ended[added] ? 0 : 8 + (uint32_t)(sf_rand(&rng) % 24);
            rq.priority = (int32_t)(sf_rand(&rng) % 3);
            KVT_EQ(kvs_sched_add(s, &rq, &ids[added]), KVS_OK);
            live[added] = 1;
            added++;
            res.adds++;
        }
        if (step == 21 || step == 28 || step == 45) { /* abort one: decoding, just added, prefilling */
            int v = step == 21 ? 9 : step == 28 ? 14 : 22;
            kvs_slot_info info;
            if (live[v] && kvs_sched_get_slot(s, ids[v], &info) == KVS_OK && info.state != KVS_SLOT_FINISHED) {
                KVT_EQ(kvs_sched_abort(s, ids[v]), KVS_OK);
                res.aborts++;
            }
        }
        if (added == WL_REQUESTS && kvs_sched_idle(s)) {
            res.idle = 1;
            break;
        }
        KVT_EQ(kvs_sched_step(s, &st), KVS_OK);
        res.steps++;
        KVT_EQ(kvs_sched_complete(s, &st), KVS_OK);
        for (size_t k = 0; k < st.num_prefill + st.num_decode; k++) {
            uint64_t id = k < st.num_prefill ? st.prefill[k].request : st.decode[k - st.num_prefill].request;
            kvs_slot_info info;
            if (kvs_sched_get_slot(s, id, &info) != KVS_OK) continue;
            if (info.state == KVS_SLOT_DECODING && info.num_computed == info.num_tokens) {
                /* one token, or for the open-ended requests (ids 5, 10, ...) several at once, as
                 * speculative decoding accepts them: up to more than an APPEND event carries itself, so
                 * TOKENS events follow it */
                uint32_t tok[24];
                size_t nt = id % 5 == 0 ? 1 + (size_t)(sf_rand(&rng) % 24) : 1;
                for (size_t j = 0; j < nt; j++) tok[j] = sf_sample(id, info.num_tokens + j);
                KVT_EQ(kvs_sched_append(s, id, tok, nt), KVS_OK);
                res.appends++;
                for (int i = 0; i < added; i++)
                    if (ids[i] == id && open_ended[i] && info.generated + 1 >= 12 &&
                        kvs_sched_get_slot(s, id, &info) == KVS_OK && info.state != KVS_SLOT_FINISHED) {
                        KVT_EQ(kvs_sched_finish(s, id), KVS_OK);
                        res.finishes++;
                    }
            }
        }
        for (int i = 0; i < added; i++) {
            kvs_slot_info info;
            if (live[i] && kvs_sched_get_slot(s, ids[i], &info) == KVS_OK && info.state == KVS_SLOT_FINISHED) {
                KVT_EQ(kvs_sched_release(s, ids[i]), KVS_OK);
                live[i] = 0;
                res.releases++;
            }
        }
    }
    KVT_CHECK(res.idle);
    return res;
}

static kvs_recorder *new_recorder(kvs_bus *bus, const char *log_path)
{
    kvs_recorder_config rc;
    kvs_recorder *rec = NULL;
    memset(&rc, 0, sizeof rc);
    rc.capacity = 1u << 16;
    rc.log_path = log_path;
    KVT_EQ(kvs_recorder_create(bus, &rc, &rec), KVS_OK);
    return rec;
}

/* The recorder's whole timeline (malloc'd; *n events). Nothing may have been dropped. */
static kvs_event *snapshot_all(kvs_recorder *rec, size_t *n)
{
    size_t count = 0, got = 0;
    uint64_t dropped = 1;
    kvs_event *ev;
    KVT_EQ(kvs_recorder_snapshot(rec, NULL, 0, &count, &dropped), KVS_OK);
    ev = (kvs_event *)calloc(count ? count : 1, sizeof *ev);
    KVT_CHECK(ev != NULL);
    if (!ev) return NULL;
    KVT_EQ(kvs_recorder_snapshot(rec, ev, count, &got, &dropped), KVS_OK);
    KVT_EQ(got, count);
    KVT_EQ(dropped, 0);
    *n = got;
    return ev;
}

/* Records the workload (seed) on a fresh bus + scheduler; returns the timeline. */
static kvs_event *record_workload(uint64_t seed, size_t *n, const char *log_path, wl_result *out_res)
{
    obs_env e;
    kvs_bus *bus = new_bus();
    kvs_recorder *rec = new_recorder(bus, log_path);
    kvs_event *ev;
    wl_result res;
    obs_open(&e, WL_DEVICE_BLOCKS, 0, bus);
    res = run_workload(e.s, seed);
    if (out_res) *out_res = res;
    ev = snapshot_all(rec, n);
    kvs_recorder_destroy(rec);
    obs_close(&e);
    kvs_bus_destroy(bus);
    return ev;
}

/* Replays events into a fresh scheduler with this device size and budget. */
static kvs_result replay_into(uint32_t device_blocks, uint32_t max_tokens, const kvs_event *ev, size_t n,
                              kvs_replay_report *rep)
{
    obs_env e;
    kvs_bus *bus = new_bus();
    kvs_result r;
    obs_open(&e, device_blocks, max_tokens, bus);
    memset(rep, 0, sizeof *rep);
    r = kvs_replay(e.s, bus, ev, n, 0, rep);
    obs_close(&e);
    kvs_bus_destroy(bus);
    return r;
}

static void print_replay_report(kvs_result r, const kvs_replay_report *rep)
{
    char a[512] = "", b[512] = "";
    size_t len;
    if (r == KVS_OK) return;
    kvs_event_to_json(&rep->expected, a, sizeof a, &len);
    kvs_event_to_json(&rep->got, b, sizeof b, &len);
    fprintf(stderr, "  replay: %s; inputs %" PRIu64 ", compared %" PRIu64 ", mismatch at seq %" PRIu64
            "\n    expected %s\n    got      %s\n", kvs_result_string(r), rep->inputs, rep->compared,
            rep->mismatch_seq, a, b);
}

/* =========================================================================================================
 * 1. events: binary and JSON forms
 * ======================================================================================================= */

static void every_event_kind_survives_the_binary_form(void)
{
    for (int k = 1; k < KVS_EV__COUNT; k++) {
        kvs_event e = sample_event((kvs_event_kind)k), back;
        unsigned char rec[KVS_RECORD_BYTES];
        memset(rec, 0xa5, sizeof rec);
        KVT_EQ(kvs_event_encode(&e, rec), KVS_OK);
        memset(&back, 0x5a, sizeof back);
        KVT_EQ(kvs_event_decode(rec, &back), KVS_OK);
        if (!events_equal(&e, &back)) explain_diff("binary round trip", &e, &back);
        KVT_CHECK(events_equal(&e, &back));
    }
}

/* "these bytes, little-endian, + CRC-32C": the record is the struct's 80 bytes and their CRC-32C. */
static void binary_record_is_the_struct_bytes_and_their_crc32c(void)
{
    static const unsigned char check[] = "123456789";
    kvs_event e = sample_event(KVS_EV_ADMIT);
    unsigned char rec[KVS_RECORD_BYTES];
    KVT_EQ(crc32c(check, 9), 0xe3069283u); /* the test's own CRC is the standard one */
    KVT_EQ(sizeof(kvs_event), 80);
    KVT_EQ(KVS_RECORD_BYTES, sizeof(kvs_event) + 4);
    KVT_EQ(kvs_event_encode(&e, rec), KVS_OK);
    if (little_endian_host()) KVT_CHECK(memcmp(rec, &e, sizeof e) == 0);
    KVT_EQ(le32(rec + 80), crc32c(rec, 80));
}

/* The header's two CRC-32C paths (the x86-64 crc32 instruction and the byte table) agree with this
 * test's own CRC on every length and alignment. */
static void both_crc_paths_agree(void)
{
    unsigned char buf[300];
    uint64_t rng = 42;
    for (size_t i = 0; i < sizeof buf; i++) {
        rng = rng * 6364136223846793005u + 1442695040888963407u;
        buf[i] = (unsigned char)(rng >> 56);
    }
    for (size_t off = 0; off < 8; off++)
        for (size_t n = 0; n + off <= sizeof buf; n += 13) {
            KVT_EQ(kvs__crc32c_sw(buf + off, n), crc32c(buf + off, n));
            KVT_EQ(kvs__crc32c(buf + off, n), crc32c(buf + off, n));
        }
}

static void decode_rejects_damaged_records(void)
{
    kvs_event e = sample_event(KVS_EV_STEP), out;
    unsigned char rec[KVS_RECORD_BYTES], bad[KVS_RECORD_BYTES];
    KVT_EQ(kvs_event_encode(&e, rec), KVS_OK);
    for (size_t at = 0; at < KVS_RECORD_BYTES; at += 7) { /* a flipped bit anywhere, CRC included */
        memcpy(bad, rec, sizeof bad);
        bad[at] ^= 0x10;
        KVT_EQ(kvs_event_decode(bad, &out), KVS_ELOG);
    }
    /* a valid CRC over a wrong kind or version is still rejected */
    if (little_endian_host()) {
        memcpy(bad, rec, sizeof bad);
        bad[offsetof(kvs_event, kind)] = (unsigned char)KVS_EV__COUNT;
        put_le32(bad + 80, crc32c(bad, 80));
        KVT_EQ(kvs_event_decode(bad, &out), KVS_ELOG);
        memcpy(bad, rec, sizeof bad);
        bad[offsetof(kvs_event, kind)] = 0;
        put_le32(bad + 80, crc32c(bad, 80));
        KVT_EQ(kvs_event_decode(bad, &out), KVS_ELOG);
        memcpy(bad, rec, sizeof bad);
        bad[offsetof(kvs_event, version)] = KVS_EVENT_VERSION + 1;
        put_le32(bad + 80, crc32c(bad, 80));
        KVT_EQ(kvs_event_decode(bad, &out), KVS_ELOG);
    }
}

static void every_event_kind_survives_the_json_form(void)
{
    for (int k = 1; k < KVS_EV__COUNT; k++) {
        kvs_event e = sample_event((kvs_event_kind)k), back;
        char json[1024];
        size_t len = 0;
        KVT_EQ(kvs_event_to_json(&e, json, sizeof json, &len), KVS_OK);
        KVT_EQ(len, strlen(json));
        KVT_CHECK(len > 2 && json[0] == '{' && json[len - 1] == '}');
        KVT_CHECK(strchr(json, '\n') == NULL); /* one line */
        memset(&back, 0x5a, sizeof back);
        KVT_EQ(kvs_event_from_json(json, &back), KVS_OK);
        if (!events_equal(&e, &back)) {
            fprintf(stderr, "  %s\n", json);
            explain_diff("JSON round trip", &e, &back);
        }
        KVT_CHECK(events_equal(&e, &back));
    }
}

static int json_has(const char *json, const char *key, const char *name)
{
    char want[128];
    snprintf(want, sizeof want, "\"%s\":\"%s\"", key, name);
    if (strstr(json, want)) return 1;
    fprintf(stderr, "  %s lacks %s\n", json, want);
    return 0;
}

static void json_names_kinds_states_and_stages(void)
{
    kvs_event slot = sample_event(KVS_EV_SLOT), xfer = sample_event(KVS_EV_TRANSFER);
    char json[1024];
    size_t len;
    KVT_EQ(kvs_event_to_json(&slot, json, sizeof json, &len), KVS_OK);
    KVT_CHECK(json_has(json, "kind", "slot"));
    KVT_CHECK(json_has(json, "kind", kvs_event_kind_name(KVS_EV_SLOT)));
    KVT_CHECK(json_has(json, "from", kvs_slot_state_name(KVS_SLOT_PREFILLING)));
    KVT_CHECK(json_has(json, "to", "Decoding"));
    KVT_EQ(kvs_event_to_json(&xfer, json, sizeof json, &len), KVS_OK);
    KVT_CHECK(json_has(json, "kind", kvs_event_kind_name(KVS_EV_TRANSFER)));
    KVT_CHECK(strstr(json, "\"Failed\"") != NULL);
    KVT_CHECK(strcmp(kvs_transfer_stage_name(KVS_XFER_FAILED), "Failed") == 0);
    /* every kind and stage has a distinct name */
    for (int a = 1; a < KVS_EV__COUNT; a++)
        for (int b = a + 1; b < KVS_EV__COUNT; b++)
            KVT_CHECK(strcmp(kvs_event_kind_name((kvs_event_kind)a), kvs_event_kind_name((kvs_event_kind)b)) != 0);
    for (int a = KVS_XFER_PENDING; a <= KVS_XFER_FAILED; a++)
        for (int b = a + 1; b <= KVS_XFER_FAILED; b++)
            KVT_CHECK(strcmp(kvs_transfer_stage_name((kvs_transfer_stage)a),
                             kvs_transfer_stage_name((kvs_transfer_stage)b)) != 0);
    for (int a = 1; a < KVS_CALL__COUNT; a++) KVT_CHECK(kvs_call_name((kvs_call)a) != NULL);
}

static void json_into_a_short_buffer_says_how_much_is_needed(void)
{
    kvs_event e = sample_event(KVS_EV_STEP);
    char full[1024], small[16];
    size_t len = 0, need = 0;
    KVT_EQ(kvs_event_to_json(&e, full, sizeof full, &len), KVS_OK);
    memset(small, 'x', sizeof small);
    KVT_EQ(kvs_event_to_json(&e, small, sizeof small, &need), KVS_ENOSPACE);
    KVT_EQ(need, len);
    for (size_t i = 0; i < sizeof small; i++) KVT_CHECK(small[i] == 'x'); /* buf unchanged */
    {
        char *exact = (char *)malloc(len + 1);
        KVT_CHECK(exact != NULL);
        if (!exact) return;
        need = 0;
        KVT_EQ(kvs_event_to_json(&e, exact, len, &need), KVS_ENOSPACE); /* no room for the NUL */
        KVT_EQ(need, len);
        KVT_EQ(kvs_event_to_json(&e, exact, len + 1, &need), KVS_OK);
        KVT_EQ(need, len);
        KVT_CHECK(strcmp(exact, full) == 0);
        free(exact);
    }
}

static void json_parser_rejects_what_the_writer_never_writes(void)
{
    kvs_event e = sample_event(KVS_EV_SLOT), out;
    char json[1024], bad[1100];
    size_t len;
    const char *p;
    static const char *garbage[] = {"", "{", "}", "[]", "null", "not json", "{\"kind\":\"slot\"", "{\"kind\":42}",
                                    "{\"kind\":\"no_such_kind\",\"seq\":1}",
                                    /* a key twice (found by fuzzing: the second array left the first's tail) */
                                    "{\"kind\":\"tokens\",\"words\":[1,2,3],\"words\":[4]}",
                                    /* an append carries min(n, 10) of its tokens, no more, no fewer */
                                    "{\"kind\":\"append\",\"n\":3,\"words\":[1,2]}",
                                    "{\"kind\":\"append\",\"n\":12,\"words\":[1,2,3,4,5,6,7,8,9,10,11]}"};
    for (size_t i = 0; i < sizeof garbage / sizeof garbage[0]; i++)
        KVT_EQ(kvs_event_from_json(garbage[i], &out), KVS_EINVAL);
    KVT_EQ(kvs_event_to_json(&e, json, sizeof json, &len), KVS_OK);
    p = strstr(json, "\"kind\":\"slot\"");
    KVT_CHECK(p != NULL);
    if (p) { /* the writer's own line with an unknown kind name */
        snprintf(bad, sizeof bad, "%.*s\"kind\":\"slop\"%s", (int)(p - json), json, p + strlen("\"kind\":\"slot\""));
        KVT_EQ(kvs_event_from_json(bad, &out), KVS_EINVAL);
    }
    snprintf(bad, sizeof bad, "%.*s", (int)(len / 2), json); /* cut in half */
    KVT_EQ(kvs_event_from_json(bad, &out), KVS_EINVAL);
}

/* =========================================================================================================
 * 2. bus and readers
 * ======================================================================================================= */

enum { FLOOD = 10000, SLOW_CAP = 64 };

typedef struct flood_sub {
    uint64_t count, gaps, last_seq, first_seq;
} flood_sub;

static void flood_count(void *user, const kvs_event *ev)
{
    flood_sub *f = (flood_sub *)user;
    if (!f->count) f->first_seq = ev->seq;
    else if (ev->seq != f->last_seq + 1) f->gaps++;
    f->last_seq = ev->seq;
    f->count++;
}

typedef struct flood_job {
    kvs_bus *bus;
    int errors;
    atomic_int done;
} flood_job;

/* kinds: every 4th event is a STEP (u.step.step = i), the others SLOT; u.slot.tokens = i for all. */
static void *flood_publish(void *arg)
{
    flood_job *j = (flood_job *)arg;
    for (uint64_t i = 0; i < FLOOD; i++) {
        kvs_event ev;
        memset(&ev, 0, sizeof ev);
        if (i % 4 == 0) {
            ev.kind = KVS_EV_STEP;
            ev.u.step.step = i;
        } else {
            ev.kind = KVS_EV_SLOT;
            ev.request = i;
            ev.u.slot.from = KVS_SLOT_PREFILLING;
            ev.u.slot.to = KVS_SLOT_DECODING;
            ev.u.slot.tokens = i;
        }
        if (kvs_bus_publish(j->bus, &ev) != KVS_OK || ev.seq != i + 1) j->errors++;
    }
    atomic_store(&j->done, 1);
    return NULL;
}

static uint64_t flood_index(const kvs_event *ev) { return ev->kind == KVS_EV_STEP ? ev->u.step.step : ev->u.slot.tokens; }

/* Waits for the flag (polling) at most timeout_us; 1 when it was set. */
static int wait_flag(atomic_int *flag, uint64_t timeout_us)
{
    uint64_t until = of_now_us() + timeout_us;
    while (!atomic_load(flag)) {
        if (of_now_us() > until) return 0;
        of_sleep_us(500);
    }
    return 1;
}

static void slow_reader_never_blocks_publishing_and_keeps_the_newest(void)
{
    kvs_bus *bus = new_bus();
    kvs_reader *slow = NULL, *steps = NULL;
    flood_sub sub;
    flood_job job;
    pthread_t th;
    uint32_t sub_id = 0;
    kvs_event *got = (kvs_event *)calloc(FLOOD, sizeof *got);
    size_t n = 0;
    uint64_t lost = 12345;
    KVT_CHECK(got != NULL);
    if (!bus || !got) return;
    memset(&sub, 0, sizeof sub);
    memset(&job, 0, sizeof job);
    job.bus = bus;
    KVT_EQ(kvs_reader_open(bus, 0, SLOW_CAP, &slow), KVS_OK);
    KVT_EQ(kvs_reader_open(bus, KVS_EV_MASK(KVS_EV_STEP), FLOOD, &steps), KVS_OK);
    KVT_EQ(kvs_bus_subscribe(bus, 0, flood_count, &sub, &sub_id), KVS_OK);
    KVT_EQ(pthread_create(&th, NULL, flood_publish, &job), 0);
    if (!wait_flag(&job.done, 5000000)) { /* a hang guard, not a speed check */
        fprintf(stderr, "  publishing 10000 events did not finish within 5 s: a reader blocks it\n");
        KVT_CHECK(0);
        return; /* the publisher may still hold the bus: leave everything */
    }
    pthread_join(th, NULL);
    KVT_EQ(job.errors, 0);

    /* the callback saw every event, seq 1..FLOOD without gaps */
    KVT_EQ(sub.count, FLOOD);
    KVT_EQ(sub.first_seq, 1);
    KVT_EQ(sub.last_seq, FLOOD);
    KVT_EQ(sub.gaps, 0);

    /* the slow reader: the newest 64, oldest first; the rest lost */
    KVT_EQ(kvs_reader_read(slow, got, FLOOD, &n, &lost), KVS_OK);
    KVT_EQ(n, SLOW_CAP);
    KVT_EQ(lost, FLOOD - SLOW_CAP);
    for (size_t i = 0; i < n && i < SLOW_CAP; i++) {
        KVT_EQ(got[i].seq, FLOOD - SLOW_CAP + 1 + i);
        KVT_EQ(flood_index(&got[i]), FLOOD - SLOW_CAP + i);
        KVT_EQ(got[i].version, KVS_EVENT_VERSION);
    }
    n = 99;
    lost = 99;
    KVT_EQ(kvs_reader_read(slow, got, FLOOD, &n, &lost), KVS_OK);
    KVT_EQ(n, 0);
    KVT_EQ(lost, 0);

    /* the STEP reader: only STEP events, all of them */
    n = 0;
    lost = 99;
    KVT_EQ(kvs_reader_read(steps, got, FLOOD, &n, &lost), KVS_OK);
    KVT_EQ(n, FLOOD / 4);
    KVT_EQ(lost, 0);
    for (size_t i = 0; i < n; i++) {
        KVT_EQ(got[i].kind, KVS_EV_STEP);
        KVT_EQ(got[i].u.step.step, 4 * i);
        KVT_EQ(got[i].seq, 4 * i + 1);
    }
    KVT_EQ(kvs_bus_unsubscribe(bus, sub_id), KVS_OK);
    kvs_reader_close(slow);
    kvs_reader_close(steps);
    kvs_bus_destroy(bus);
    free(got);
}

static void reader_reads_in_pieces_and_unsubscribed_callbacks_stop(void)
{
    kvs_bus *bus = new_bus();
    kvs_reader *r = NULL;
    flood_sub sub;
    uint32_t id = 0;
    kvs_event got[8];
    size_t n = 0;
    uint64_t lost = 9;
    memset(&sub, 0, sizeof sub);
    KVT_EQ(kvs_reader_open(bus, KVS_EV_MASK(KVS_EV_SLOT) | KVS_EV_MASK(KVS_EV_ADMIT), 0, &r), KVS_OK);
    KVT_EQ(kvs_bus_subscribe(bus, KVS_EV_MASK(KVS_EV_ADMIT), flood_count, &sub, &id), KVS_OK);
    for (int i = 0; i < 12; i++) {
        kvs_event ev = sample_event(i % 3 == 0 ? KVS_EV_ADMIT : i % 3 == 1 ? KVS_EV_SLOT : KVS_EV_TIERS);
        KVT_EQ(kvs_bus_publish(bus, &ev), KVS_OK);
        KVT_EQ(ev.seq, (uint64_t)i + 1);
        if (i == 5) KVT_EQ(kvs_bus_unsubscribe(bus, id), KVS_OK);
    }
    KVT_EQ(sub.count, 2); /* ADMIT events 1 and 4 */
    KVT_EQ(kvs_reader_read(r, got, 5, &n, &lost), KVS_OK);
    KVT_EQ(n, 5);
    KVT_EQ(lost, 0);
    KVT_EQ(kvs_reader_read(r, got + 5, 3, &n, &lost), KVS_OK);
    KVT_EQ(n, 3); /* 8 of 12 are SLOT or ADMIT */
    for (int i = 0; i < 8; i++) {
        KVT_CHECK(got[i].kind == KVS_EV_SLOT || got[i].kind == KVS_EV_ADMIT);
        if (i) KVT_CHECK(got[i].seq > got[i - 1].seq);
    }
    kvs_reader_close(r);
    kvs_bus_destroy(bus);
}

static uint64_t fake_now(void *user) { return (*(uint64_t *)user += 1000); }

static void bus_clock_stamps_time(void)
{
    uint64_t now = 5000;
    kvs_bus_config bc;
    kvs_bus *bus = NULL;
    kvs_event ev = sample_event(KVS_EV_SLOT);
    memset(&bc, 0, sizeof bc);
    bc.clock = fake_now;
    bc.clock_user = &now;
    KVT_EQ(kvs_bus_create(&bc, &bus), KVS_OK);
    ev.version = 0;
    KVT_EQ(kvs_bus_publish(bus, &ev), KVS_OK);
    KVT_EQ(ev.time_ns, now);
    KVT_EQ(ev.seq, 1);
    KVT_EQ(ev.version, KVS_EVENT_VERSION);
    kvs_bus_destroy(bus);
}

/* kvb_pool_config.on_events = kvs_bus_pool_events: a registration is a BLOCK_STORED event with the
 * pool's tier and the block's hash; a clear is BLOCK_CLEARED. */
static void pool_events_reach_the_bus_as_block_events(void)
{
    kvs_bus *bus = new_bus();
    kvs_reader *r = NULL;
    kvb_pool_config pc;
    kvb_pool *pool = NULL;
    kvb_hash h[3];
    kvs_event got[16];
    size_t n = 0, stored = 0;
    memset(&pc, 0, sizeof pc);
    pc.num_blocks = 8;
    pc.block_tokens = OF_TOKENS;
    pc.tier = 1;
    pc.on_events = kvs_bus_pool_events;
    pc.event_user = bus;
    KVT_EQ(kvs_reader_open(bus, 0, 64, &r), KVS_OK);
    KVT_EQ(kvb_pool_create(&pc, &pool), KVB_OK);
    of_chain(9, 3, h);
    of_register(pool, h, 3, NULL, NULL);
    KVT_EQ(kvs_reader_read(r, got, 16, &n, NULL), KVS_OK);
    for (size_t i = 0; i < n; i++) {
        if (got[i].kind != KVS_EV_BLOCK_STORED) continue;
        KVT_EQ(got[i].u.block.tier, 1);
        KVT_EQ(got[i].u.block.tokens, OF_TOKENS);
        if (stored < 3) {
            KVT_CHECK(of_hash_eq(got[i].u.block.hash, h[stored]));
            if (stored) KVT_CHECK(of_hash_eq(got[i].u.block.parent, h[stored - 1]));
        }
        stored++;
    }
    KVT_EQ(stored, 3);
    kvb_pool_destroy(pool);
    kvs_reader_close(r);
    kvs_bus_destroy(bus);
}

/* kvo_pipeline_config.on_stage = kvs_bus_transfer_stage: one offload goes PendingEvaluation ->
 * Promoted ... -> Completed, with its blocks, tiers and copied count. */
static void transfer_stages_reach_the_bus(void)
{
    kvs_bus *bus = new_bus();
    kvs_reader *r = NULL;
    kvb_pool_config pc;
    kvb_pool *src = NULL, *dst = NULL;
    kvo_backend *copy = NULL;
    kvo_pipeline *pl;
    kvo_pipeline_config plc;
    of_clock clock = {1000000};
    kvb_hash h[4];
    kvb_weak w[4];
    kvo_transfer t;
    kvs_event got[64];
    size_t n = 0;
    memset(&pc, 0, sizeof pc);
    pc.num_blocks = 8;
    pc.block_tokens = OF_TOKENS;
    pc.storage = KVB_STORAGE_HOST;
    pc.layout = of_layout(KVB_LAYOUT_BLOCK_CONTIGUOUS);
    src = of_pool_from(&pc);
    pc.tier = 1;
    pc.layout = of_layout(KVB_LAYOUT_LAYER_SEPARATE);
    dst = of_pool_from(&pc);
    KVT_EQ(kvo_memcpy_backend_create(0, &copy), KVO_OK);
    plc = of_config(src, dst, copy, KVO_MODE_POLL, &clock);
    plc.min_batch = 1;
    plc.on_stage = kvs_bus_transfer_stage;
    plc.stage_user = bus;
    KVT_EQ(kvs_reader_open(bus, KVS_EV_MASK(KVS_EV_TRANSFER), 64, &r), KVS_OK);
    pl = of_pipeline(&plc);
    of_chain(3, 4, h);
    of_register(src, h, 4, NULL, w);
    t = of_enqueue(pl, w, 4, NULL);
    KVT_EQ(of_pump(pl, &clock, t, 100000, 200), KVO_STATUS_COMPLETE);
    KVT_EQ(kvs_reader_read(r, got, 64, &n, NULL), KVS_OK);
    KVT_CHECK(n >= 2);
    if (n >= 2) {
        KVT_EQ(got[0].u.transfer.stage, KVS_XFER_PENDING);
        KVT_EQ(got[n - 1].u.transfer.stage, KVS_XFER_COMPLETED);
        KVT_EQ(got[n - 1].u.transfer.moved, 4);
        for (size_t i = 0; i < n; i++) {
            KVT_EQ(got[i].u.transfer.transfer, t.id);
            KVT_EQ(got[i].u.transfer.src_tier, 0);
            KVT_EQ(got[i].u.transfer.dst_tier, 1);
            KVT_EQ(got[i].u.transfer.blocks, 4);
            KVT_EQ(got[i].u.transfer.onboard, 0);
            if (i && i + 1 < n) KVT_EQ(got[i].u.transfer.stage, KVS_XFER_PROMOTED);
        }
    }
    kvo_transfer_release(pl, t);
    kvo_pipeline_destroy(pl);
    kvo_backend_destroy(copy);
    kvb_pool_destroy(dst);
    kvb_pool_destroy(src);
    kvs_reader_close(r);
    kvs_bus_destroy(bus);
}

/* =========================================================================================================
 * 3. recorder and log file
 * ======================================================================================================= */

/* A short scheduler run recorded to a log file at path (every kind, pool events included). */
static kvs_event *record_small_run(const char *path, size_t *n)
{
    kvs_bus *bus = new_bus();
    kvs_recorder *rec = new_recorder(bus, path);
    obs_env e;
    kvs_event *ev;
    kvs_sched_config sc;
    kvb_pool_config pc;
    uint32_t prompt[80];
    memset(&pc, 0, sizeof pc);
    pc.num_blocks = 16;
    pc.block_tokens = OF_TOKENS;
    pc.on_events = kvs_bus_pool_events;
    pc.event_user = bus;
    memset(&e, 0, sizeof e);
    e.bus = bus;
    e.dev = of_pool_from(&pc);
    memset(&sc, 0, sizeof sc);
    sc.device = e.dev;
    sc.bus = bus;
    KVT_EQ(kvs_sched_create(&sc, &e.s), KVS_OK);
    for (int i = 0; i < 3; i++) {
        kvs_request rq;
        uint64_t id;
        memset(&rq, 0, sizeof rq);
        sf_tokens(500 + (uint64_t)i, prompt, 80);
        rq.prompt = prompt;
        rq.num_prompt = 40 + 10 * (size_t)i;
        rq.max_new_tokens = 4;
        KVT_EQ(kvs_sched_add(e.s, &rq, &id), KVS_OK);
    }
    for (int i = 0; i < 40 && !kvs_sched_idle(e.s); i++) {
        kvs_step st;
        KVT_EQ(kvs_sched_step(e.s, &st), KVS_OK);
        KVT_EQ(kvs_sched_complete(e.s, &st), KVS_OK);
        for (size_t k = 0; k < st.num_prefill + st.num_decode; k++) {
            uint64_t id = k < st.num_prefill ? st.prefill[k].request : st.decode[k - st.num_prefill].request;
            kvs_slot_info info;
            if (kvs_sched_get_slot(e.s, id, &info) == KVS_OK && info.state == KVS_SLOT_DECODING &&
                info.num_computed == info.num_tokens) {
                uint32_t tok = sf_sample(id, info.num_tokens);
                KVT_EQ(kvs_sched_append(e.s, id, &tok, 1), KVS_OK);
            }
        }
    }
    KVT_CHECK(kvs_sched_idle(e.s));
    KVT_EQ(kvs_recorder_flush(rec), KVS_OK);
    ev = snapshot_all(rec, n);
    kvs_recorder_destroy(rec);
    obs_close(&e);
    kvs_bus_destroy(bus);
    return ev;
}

static void check_prefix_equal(const kvs_event *want, const kvs_event *got, size_t n)
{
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        if (!events_equal(&want[i], &got[i])) {
            if (!bad) explain_diff("log record", &want[i], &got[i]);
            bad++;
        }
    KVT_EQ(bad, 0);
}

static void log_file_reads_back_what_was_recorded(void)
{
    char path[64];
    size_t n = 0, m = 0, bytes = 0;
    kvs_event *rec, *log = NULL;
    kvs_log_report rep;
    unsigned char *file;
    unsigned kinds = 0;
    KVT_CHECK(make_temp(path, sizeof path));
    rec = record_small_run(path, &n);
    KVT_CHECK(n > 20);
    for (size_t i = 0; rec && i < n; i++) kinds |= 1u << rec[i].kind;
    KVT_CHECK(kinds & (1u << KVS_EV_SLOT));
    KVT_CHECK(kinds & (1u << KVS_EV_ADMIT));
    KVT_CHECK(kinds & (1u << KVS_EV_STEP));
    KVT_CHECK(kinds & (1u << KVS_EV_BLOCK_STORED));
    KVT_CHECK(kinds & (1u << KVS_EV_ADD));
    KVT_CHECK(kinds & (1u << KVS_EV_TOKENS));
    file = read_file(path, &bytes);
    KVT_EQ(bytes, KVS_LOG_HEADER_BYTES + n * KVS_RECORD_BYTES);
    free(file);
    memset(&rep, 0xff, sizeof rep);
    KVT_EQ(kvs_log_read(path, &log, &m, &rep), KVS_OK);
    KVT_EQ(m, n);
    KVT_EQ(rep.records, n);
    KVT_EQ(rep.damaged_at, 0);
    KVT_EQ(rep.truncated, 0);
    KVT_EQ(rep.corrupt, 0);
    if (rec && log && m == n) check_prefix_equal(rec, log, n);
    for (size_t i = 0; log && i < m; i++) KVT_EQ(log[i].seq, i + 1);
    kvs_log_free(log);
    free(rec);
    unlink(path);
}

static void cut_short_log_keeps_the_whole_records(void)
{
    char path[64];
    size_t n = 0, m = 0, bytes = 0;
    kvs_event *rec, *log = NULL;
    kvs_log_report rep;
    unsigned char *file;
    KVT_CHECK(make_temp(path, sizeof path));
    rec = record_small_run(path, &n);
    file = read_file(path, &bytes);
    KVT_CHECK(file && n > 2 && bytes == KVS_LOG_HEADER_BYTES + n * KVS_RECORD_BYTES);
    if (file && n > 2) {
        KVT_CHECK(write_file(path, file, bytes - 5));
        memset(&rep, 0, sizeof rep);
        KVT_EQ(kvs_log_read(path, &log, &m, &rep), KVS_ELOG);
        KVT_EQ(rep.truncated, 1);
        KVT_EQ(rep.corrupt, 0);
        KVT_EQ(rep.records, n - 1);
        KVT_EQ(m, n - 1);
        KVT_EQ(rep.damaged_at, KVS_LOG_HEADER_BYTES + (n - 1) * KVS_RECORD_BYTES);
        if (log && m == n - 1) check_prefix_equal(rec, log, m);
        kvs_log_free(log);
    }
    free(file);
    free(rec);
    unlink(path);
}

static void corrupt_record_stops_the_log_where_it_is(void)
{
    char path[64];
    size_t n = 0, m = 0, bytes = 0, k;
    kvs_event *rec, *log = NULL;
    kvs_log_report rep;
    unsigned char *file;
    KVT_CHECK(make_temp(path, sizeof path));
    rec = record_small_run(path, &n);
    file = read_file(path, &bytes);
    k = n / 2;
    KVT_CHECK(file && n > 2 && bytes == KVS_LOG_HEADER_BYTES + n * KVS_RECORD_BYTES);
    if (file && n > 2) {
        file[KVS_LOG_HEADER_BYTES + k * KVS_RECORD_BYTES + 40] ^= 0x01;
        KVT_CHECK(write_file(path, file, bytes));
        memset(&rep, 0, sizeof rep);
        KVT_EQ(kvs_log_read(path, &log, &m, &rep), KVS_ELOG);
        KVT_EQ(rep.corrupt, 1);
        KVT_EQ(rep.truncated, 0);
        KVT_EQ(rep.damaged_at, KVS_LOG_HEADER_BYTES + k * KVS_RECORD_BYTES);
        KVT_EQ(rep.records, k);
        KVT_EQ(m, k);
        if (log && m == k) check_prefix_equal(rec, log, m);
        kvs_log_free(log);
    }
    free(file);
    free(rec);
    unlink(path);
}

/* Records kvs_log_read reads before its file's reads start failing; 0: they never do. */
static size_t log_reads_fail_after;

/* The stream's descriptor becomes one open for writing only: its buffered bytes still read, the next
 * read(2) fails (EBADF), as a disk's I/O error would. */
static void log_between_records(FILE *f)
{
    int wo;
    if (!log_reads_fail_after || --log_reads_fail_after) return;
    if ((wo = open("/dev/null", O_WRONLY)) < 0) return;
    (void)dup2(wo, fileno(f));
    close(wo);
}

/* A read that fails part way through a sound log is an I/O error, not the log's end and not damage:
 * before, the records read until then came back as the whole log (KVS_OK). */
static void read_error_in_the_middle_of_a_log_is_an_io_error(void)
{
    char path[64];
    size_t n = 0, m = 7, bytes = 0, copies = 0;
    kvs_event *rec, *log = NULL, *sentinel = (kvs_event *)&m;
    kvs_log_report rep;
    unsigned char *file, *big;
    KVT_CHECK(make_temp(path, sizeof path));
    rec = record_small_run(path, &n);
    file = read_file(path, &bytes);
    KVT_CHECK(file && n > 0 && bytes == KVS_LOG_HEADER_BYTES + n * KVS_RECORD_BYTES);
    /* the same records over and over, 64 KiB and more: far past what one read of the stream buffers */
    while (file && n && copies * n * KVS_RECORD_BYTES < 65536) copies++;
    big = file ? (unsigned char *)malloc(KVS_LOG_HEADER_BYTES + copies * n * KVS_RECORD_BYTES) : NULL;
    KVT_CHECK(big != NULL);
    if (big) {
        memcpy(big, file, KVS_LOG_HEADER_BYTES);
        for (size_t c = 0; c < copies; c++)
            memcpy(big + KVS_LOG_HEADER_BYTES + c * n * KVS_RECORD_BYTES, file + KVS_LOG_HEADER_BYTES, n * KVS_RECORD_BYTES);
        KVT_CHECK(write_file(path, big, KVS_LOG_HEADER_BYTES + copies * n * KVS_RECORD_BYTES));
        KVT_EQ(kvs_log_read(path, &log, &m, &rep), KVS_OK); /* sound, read whole */
        KVT_EQ(m, copies * n);
        kvs_log_free(log);
        log = sentinel;
        m = 7;
        log_reads_fail_after = 1;
        KVT_EQ(kvs_log_read(path, &log, &m, &rep), KVS_EIO);
        KVT_EQ(log_reads_fail_after, 0); /* the seam was reached */
        KVT_CHECK(log == sentinel);       /* nothing returned */
        KVT_EQ(m, 7);
        log_reads_fail_after = 0;
    }
    free(big);
    free(file);
    free(rec);
    unlink(path);
}

static void missing_or_foreign_file_is_an_io_error(void)
{
    char path[64], text[256];
    kvs_event *log = NULL;
    size_t m = 7;
    kvs_log_report rep;
    KVT_CHECK(make_temp(path, sizeof path));
    unlink(path);
    memset(&rep, 0, sizeof rep);
    KVT_EQ(kvs_log_read(path, &log, &m, &rep), KVS_EIO);
    kvs_log_free(log);
    log = NULL;
    memset(text, 0, sizeof text);
    for (size_t i = 0; i + 1 < sizeof text; i++) text[i] = "this is not an event log\n"[i % 25];
    KVT_CHECK(write_file(path, text, strlen(text)));
    KVT_EQ(kvs_log_read(path, &log, &m, &rep), KVS_EIO);
    kvs_log_free(log);
    unlink(path);
    /* a directory cannot be read as a log either; a recorder cannot create its log there */
    {
        char dir[64];
        kvs_bus *bus = new_bus();
        kvs_recorder *rec = NULL;
        kvs_recorder_config rc;
        KVT_CHECK(of_tmpdir(dir, sizeof dir));
        log = NULL;
        KVT_EQ(kvs_log_read(dir, &log, &m, &rep), KVS_EIO);
        kvs_log_free(log);
        memset(&rc, 0, sizeof rc);
        rc.log_path = dir;
        KVT_EQ(kvs_recorder_create(bus, &rc, &rec), KVS_EIO);
        KVT_CHECK(rec == NULL);
        rmdir(dir);
        kvs_bus_destroy(bus);
    }
}

/* A log whose header cannot be written (a full device) is one that cannot be created: before, the header
 * waited in the stream's buffer and kvs_recorder_create said KVS_OK, the first flush KVS_EIO. */
static void recorder_on_a_full_device_fails_at_create(void)
{
    kvs_bus *bus = new_bus();
    kvs_recorder_config rc;
    kvs_recorder *rec = NULL;
    if (access("/dev/full", W_OK) != 0) {
        kvs_bus_destroy(bus);
        KVT_SKIP("no /dev/full");
    }
    memset(&rc, 0, sizeof rc);
    rc.log_path = "/dev/full";
    KVT_EQ(kvs_recorder_create(bus, &rc, &rec), KVS_EIO);
    KVT_CHECK(rec == NULL);
    if (rec) kvs_recorder_destroy(rec);
    kvs_bus_destroy(bus);
}

static void recorder_keeps_only_its_kinds_and_counts_what_no_longer_fits(void)
{
    kvs_bus *bus = new_bus();
    kvs_recorder_config rc;
    kvs_recorder *rec = NULL;
    kvs_event got[8];
    size_t n = 0;
    uint64_t dropped = 0;
    memset(&rc, 0, sizeof rc);
    rc.capacity = 8;
    rc.kinds = KVS_EV_MASK(KVS_EV_STEP);
    KVT_EQ(kvs_recorder_create(bus, &rc, &rec), KVS_OK);
    for (uint64_t i = 0; i < 30; i++) {
        kvs_event ev = sample_event(i % 2 ? KVS_EV_STEP : KVS_EV_SLOT);
        ev.u.step.step = i;
        KVT_EQ(kvs_bus_publish(bus, &ev), KVS_OK);
    }
    KVT_EQ(kvs_recorder_snapshot(rec, NULL, 0, &n, &dropped), KVS_OK);
    KVT_EQ(n, 8);
    KVT_EQ(dropped, 15 - 8);
    KVT_EQ(kvs_recorder_snapshot(rec, got, 8, &n, NULL), KVS_OK);
    KVT_EQ(n, 8);
    for (size_t i = 0; i < n; i++) {
        KVT_EQ(got[i].kind, KVS_EV_STEP);
        KVT_EQ(got[i].u.step.step, 15 + 2 * i); /* the newest 8 of the odd ones, oldest first */
    }
    KVT_EQ(kvs_recorder_snapshot(rec, got, 3, &n, NULL), KVS_OK); /* does not consume */
    KVT_EQ(n, 3);
    kvs_recorder_destroy(rec);
    kvs_bus_destroy(bus);
}

/* =========================================================================================================
 * 4. record and replay
 * ======================================================================================================= */

static void recorded_run_preempts_and_hits_the_device_cache(void)
{
    size_t n = 0, preempted = 0, hits = 0, admits = 0, adds = 0, long_appends = 0;
    wl_result res;
    kvs_event *ev = record_workload(1, &n, NULL, &res);
    KVT_EQ(res.adds, WL_REQUESTS);
    KVT_CHECK(res.aborts >= 1);
    KVT_CHECK(res.finishes >= 1);
    KVT_CHECK(res.releases >= WL_REQUESTS - 1);
    for (size_t i = 0; ev && i < n; i++) {
        if (ev[i].kind == KVS_EV_SLOT && ev[i].u.slot.to == KVS_SLOT_PREEMPTED) preempted++;
        if (ev[i].kind == KVS_EV_ADMIT) {
            admits++;
            if (ev[i].u.admit.device_hit_tokens > 0) hits++;
        }
        if (ev[i].kind == KVS_EV_ADD) adds++;
        if (ev[i].kind == KVS_EV_APPEND && ev[i].u.append.n > 10) { /* the rest follows in TOKENS */
            long_appends++;
            KVT_CHECK(i + 1 < n && ev[i + 1].kind == KVS_EV_TOKENS && ev[i + 1].u.tokens.n == ev[i].u.append.n - 10);
        }
        KVT_EQ(ev[i].seq, i + 1);
    }
    KVT_CHECK(long_appends > 0);
    KVT_CHECK(preempted > 0);
    KVT_CHECK(hits > 0);
    KVT_CHECK(admits >= WL_REQUESTS);
    KVT_EQ(adds, WL_REQUESTS);
    free(ev);
}

static void replay_of_a_recorded_run_matches(void)
{
    size_t n = 0;
    kvs_replay_report rep;
    kvs_event *ev = record_workload(1, &n, NULL, NULL);
    kvs_result r = replay_into(WL_DEVICE_BLOCKS, 0, ev, n, &rep);
    print_replay_report(r, &rep);
    KVT_EQ(r, KVS_OK);
    KVT_CHECK(rep.compared > 100);
    KVT_CHECK(rep.inputs > 50);
    KVT_EQ(rep.mismatch_seq, 0);
    free(ev);
}

static void replay_from_the_log_file_matches(void)
{
    char path[64];
    size_t n = 0, m = 0;
    kvs_event *ev, *log = NULL;
    kvs_log_report lr;
    kvs_replay_report rep;
    kvs_result r;
    KVT_CHECK(make_temp(path, sizeof path));
    ev = record_workload(2, &n, path, NULL);
    KVT_EQ(kvs_log_read(path, &log, &m, &lr), KVS_OK);
    KVT_EQ(m, n);
    r = replay_into(WL_DEVICE_BLOCKS, 0, log, m, &rep);
    print_replay_report(r, &rep);
    KVT_EQ(r, KVS_OK);
    KVT_CHECK(rep.compared > 100);
    KVT_CHECK(rep.inputs > 50);
    kvs_log_free(log);
    free(ev);
    unlink(path);
}

/* The fresh scheduler has handed out an id before (added, aborted, released: no trace in the pool), so
 * its ids are one ahead of the recording's: replay maps them in order of addition. */
static void replay_maps_request_ids_in_order_of_addition(void)
{
    size_t n = 0;
    kvs_replay_report rep;
    kvs_event *ev = record_workload(1, &n, NULL, NULL);
    obs_env e;
    kvs_bus *bus = new_bus();
    kvs_request rq;
    uint32_t prompt[20];
    uint64_t id = 0;
    kvs_result r;
    obs_open(&e, WL_DEVICE_BLOCKS, 0, bus);
    memset(&rq, 0, sizeof rq);
    sf_tokens(8, prompt, 20);
    rq.prompt = prompt;
    rq.num_prompt = 20;
    KVT_EQ(kvs_sched_add(e.s, &rq, &id), KVS_OK);
    KVT_EQ(kvs_sched_abort(e.s, id), KVS_OK);
    KVT_EQ(kvs_sched_release(e.s, id), KVS_OK);
    memset(&rep, 0, sizeof rep);
    r = kvs_replay(e.s, bus, ev, n, 0, &rep);
    print_replay_report(r, &rep);
    KVT_EQ(r, KVS_OK);
    KVT_CHECK(rep.compared > 100);
    obs_close(&e);
    kvs_bus_destroy(bus);
    free(ev);
}

static void replay_into_another_config_reports_the_first_difference(void)
{
    size_t n = 0;
    kvs_replay_report rep;
    kvs_event *ev = record_workload(1, &n, NULL, NULL);
    kvs_result r = replay_into(WL_DEVICE_BLOCKS, 24, ev, n, &rep); /* a 24-token budget */
    KVT_EQ(r, KVS_EREPLAY);
    KVT_CHECK(rep.mismatch_seq != 0);
    KVT_CHECK(rep.mismatch_seq <= n);
    if (rep.mismatch_seq && rep.mismatch_seq <= n) { /* the recorded decision at that seq */
        KVT_EQ(rep.expected.kind, ev[rep.mismatch_seq - 1].kind);
        KVT_CHECK(memcmp(&rep.expected.u, &ev[rep.mismatch_seq - 1].u, sizeof rep.expected.u) == 0);
        KVT_CHECK(rep.expected.kind == KVS_EV_SLOT || rep.expected.kind == KVS_EV_ADMIT ||
                  rep.expected.kind == KVS_EV_STEP);
    }
    KVT_EQ(rep.got.kind, KVS_EV_STEP); /* the first step already differs: it is cut to the budget */
    KVT_CHECK(rep.got.u.step.tokens <= 24 && rep.expected.u.step.tokens > 24);
    r = replay_into(WL_DEVICE_BLOCKS / 2, 0, ev, n, &rep); /* half the device */
    KVT_EQ(r, KVS_EREPLAY);
    KVT_CHECK(rep.mismatch_seq != 0);
    KVT_EQ(rep.got.kind, KVS_EV_STEP);
    KVT_EQ(rep.got.u.step.device_blocks, WL_DEVICE_BLOCKS / 2);
    KVT_EQ(rep.expected.u.step.device_blocks, WL_DEVICE_BLOCKS);
    free(ev);
}

/* A recording whose inputs were tampered with (a different prompt token) does not replay clean. */
static void replay_of_a_tampered_recording_differs(void)
{
    size_t n = 0, i;
    kvs_replay_report rep;
    kvs_event *ev = record_workload(1, &n, NULL, NULL);
    kvs_result r;
    for (i = 0; ev && i < n; i++)
        if (ev[i].kind == KVS_EV_STEP && ev[i].u.step.step == 3) break;
    KVT_CHECK(ev && i < n);
    if (!ev || i >= n) return;
    ev[i].u.step.prefill += 1; /* a decision the fresh run will not make */
    r = replay_into(WL_DEVICE_BLOCKS, 0, ev, n, &rep);
    KVT_EQ(r, KVS_EREPLAY);
    KVT_EQ(rep.mismatch_seq, ev[i].seq);
    KVT_EQ(rep.got.kind, KVS_EV_STEP);
    KVT_EQ(rep.got.u.step.prefill + 1, ev[i].u.step.prefill);
    free(ev);
}

/* Asked to compare every kind (~0), replay compares the decisions it can and leaves the inputs, which it
 * feeds itself, out of the comparison: before, the fresh run's inputs were collected as decisions and
 * the first SLOT event was compared with an ADD (KVS_EREPLAY on a clean run). Input kinds alone leave
 * nothing to compare: KVS_EINVAL, the fresh scheduler untouched. */
static void replay_compares_no_input_kinds(void)
{
    size_t n = 0;
    kvs_replay_report rep;
    kvs_event *ev = record_workload(1, &n, NULL, NULL);
    obs_env e;
    kvs_bus *bus = new_bus();
    kvs_result r;
    obs_open(&e, WL_DEVICE_BLOCKS, 0, bus);
    memset(&rep, 0, sizeof rep);
    KVT_EQ(kvs_replay(e.s, bus, ev, n, KVS_EV_MASK(KVS_EV_ADD), &rep), KVS_EINVAL); /* nothing to compare */
    KVT_EQ(rep.inputs, 0);
    r = kvs_replay(e.s, bus, ev, n, ~0ull, &rep);
    print_replay_report(r, &rep);
    KVT_EQ(r, KVS_OK);
    KVT_CHECK(rep.compared > 100);
    KVT_EQ(rep.mismatch_seq, 0);
    obs_close(&e);
    kvs_bus_destroy(bus);
    free(ev);
}

/* Runs one request with these extra keys to the end (one generated token) and releases it. */
static void run_one_with_extra(kvs_sched *s, const uint32_t *prompt, size_t n, uint64_t key)
{
    kvs_request rq;
    kvs_step st;
    kvs_slot_info info;
    uint64_t id = 0;
    uint64_t extra[1] = {key};
    memset(&rq, 0, sizeof rq);
    rq.prompt = prompt;
    rq.num_prompt = n;
    rq.max_new_tokens = 1;
    rq.extra = extra;
    rq.num_extra = 1;
    KVT_EQ(kvs_sched_add(s, &rq, &id), KVS_OK);
    for (int i = 0; i < 16 && kvs_sched_get_slot(s, id, &info) == KVS_OK && info.state != KVS_SLOT_FINISHED; i++) {
        KVT_EQ(kvs_sched_step(s, &st), KVS_OK);
        KVT_EQ(kvs_sched_complete(s, &st), KVS_OK);
        if (kvs_sched_get_slot(s, id, &info) == KVS_OK && info.state == KVS_SLOT_DECODING &&
            info.num_computed == info.num_tokens) {
            uint32_t tok = 5;
            KVT_EQ(kvs_sched_append(s, id, &tok, 1), KVS_OK);
        }
    }
    KVT_EQ(kvs_sched_get_slot(s, id, &info), KVS_OK);
    KVT_EQ(info.state, KVS_SLOT_FINISHED);
    KVT_EQ(kvs_sched_release(s, id), KVS_OK);
}

/* Extra hash keys (a LoRA id, an image hash) travel with the recorded add: one prompt under keys 7, 9
 * and 7 again hits the cache only the third time, in the recording and in its replay. */
static void replay_carries_extra_keys(void)
{
    obs_env e;
    kvs_bus *bus = new_bus();
    kvs_recorder *rec = new_recorder(bus, NULL);
    uint32_t prompt[48];
    size_t n = 0, admits = 0;
    kvs_replay_report rep;
    uint64_t hits[3] = {0, 0, 0};
    sf_tokens(31, prompt, 48);
    obs_open(&e, WL_DEVICE_BLOCKS, 0, bus);
    run_one_with_extra(e.s, prompt, 48, 7);
    run_one_with_extra(e.s, prompt, 48, 9);
    run_one_with_extra(e.s, prompt, 48, 7);
    kvs_event *ev = snapshot_all(rec, &n);
    kvs_recorder_destroy(rec);
    obs_close(&e);
    kvs_bus_destroy(bus);
    for (size_t i = 0; ev && i < n; i++)
        if (ev[i].kind == KVS_EV_ADMIT && admits < 3) hits[admits++] = ev[i].u.admit.device_hit_tokens;
    KVT_EQ(admits, 3);
    KVT_EQ(hits[0], 0);
    KVT_EQ(hits[1], 0); /* same prompt, other key: nothing shared */
    KVT_CHECK(hits[2] >= 32); /* key 7 again: its full blocks */
    KVT_EQ(replay_into(WL_DEVICE_BLOCKS, 0, ev, n, &rep), KVS_OK);
    KVT_CHECK(rep.compared > 0);
    free(ev);
}

/* A recording cut short after an input, before the decisions that input led to: the fresh run decides
 * more than the recording holds, which is a difference too, reported one past the recording's last seq. */
static void replay_of_a_recording_cut_short_differs(void)
{
    size_t n = 0, cut = 0, i;
    kvs_replay_report rep;
    kvs_event *ev = record_workload(1, &n, NULL, NULL);
    kvs_result r;
    for (i = 0; ev && i + 1 < n; i++) /* an input followed by a decision, about halfway */
        if (i > n / 2 && ev[i].kind >= KVS_EV_ADD && ev[i].kind <= KVS_EV_RELEASE &&
            (KVS_EV_DECISIONS & KVS_EV_MASK(ev[i + 1].kind))) {
            cut = i + 1;
            break;
        }
    KVT_CHECK(cut > 0);
    if (!cut) {
        free(ev);
        return;
    }
    r = replay_into(WL_DEVICE_BLOCKS, 0, ev, cut, &rep);
    KVT_EQ(r, KVS_EREPLAY);
    KVT_EQ(rep.mismatch_seq, ev[cut - 1].seq + 1);
    KVT_EQ(rep.got.kind, ev[cut].kind); /* the first decision the recording lacks */
    KVT_CHECK(rep.compared > 0);
    r = replay_into(WL_DEVICE_BLOCKS, 0, ev, n, &rep); /* the whole recording still replays clean */
    KVT_EQ(r, KVS_OK);
    free(ev);
}

/* =========================================================================================================
 * 5. breakpoints, pauses and hooks
 * ======================================================================================================= */

/* The engine: its own thread, its own scheduler. Keeps 6 requests going (each finished after 16 tokens
 * and replaced) until told to stop, then aborts what is left. */
typedef struct engine {
    kvs_sched *s;
    pthread_t th;
    atomic_ullong steps;
    atomic_int stop, done;
    int errors;
} engine;

static void *engine_main(void *arg)
{
    engine *g = (engine *)arg;
    uint64_t ids[6];
    uint32_t prompt[48];
    int next = 0;
    for (int i = 0; i < 6; i++) {
        kvs_request rq;
        memset(&rq, 0, sizeof rq);
        sf_tokens(900 + (uint64_t)next++, prompt, 48);
        rq.prompt = prompt;
        rq.num_prompt = 48;
        if (kvs_sched_add(g->s, &rq, &ids[i]) != KVS_OK) g->errors++;
    }
    while (!atomic_load(&g->stop)) {
        kvs_step st;
        if (kvs_sched_step(g->s, &st) != KVS_OK || kvs_sched_complete(g->s, &st) != KVS_OK) {
            g->errors++;
            break;
        }
        for (int i = 0; i < 6; i++) {
            kvs_slot_info info;
            if (kvs_sched_get_slot(g->s, ids[i], &info) != KVS_OK) continue;
            if (info.state == KVS_SLOT_DECODING && info.num_computed == info.num_tokens) {
                uint32_t tok = sf_sample(ids[i], info.num_tokens);
                if (kvs_sched_append(g->s, ids[i], &tok, 1) != KVS_OK) g->errors++;
                if (info.generated + 1 >= 16) {
                    kvs_request rq;
                    if (kvs_sched_finish(g->s, ids[i]) != KVS_OK || kvs_sched_release(g->s, ids[i]) != KVS_OK)
                        g->errors++;
                    memset(&rq, 0, sizeof rq);
                    sf_tokens(900 + (uint64_t)next++, prompt, 48);
                    rq.prompt = prompt;
                    rq.num_prompt = 48;
                    if (kvs_sched_add(g->s, &rq, &ids[i]) != KVS_OK) g->errors++;
                }
            }
        }
        atomic_fetch_add(&g->steps, 1);
    }
    for (int i = 0; i < 6; i++) {
        kvs_slot_info info;
        if (kvs_sched_get_slot(g->s, ids[i], &info) == KVS_OK && info.state != KVS_SLOT_FINISHED &&
            kvs_sched_abort(g->s, ids[i]) != KVS_OK)
            g->errors++;
    }
    if (!kvs_sched_idle(g->s)) g->errors++;
    atomic_store(&g->done, 1);
    return NULL;
}

static void engine_start(engine *g, kvs_sched *s)
{
    memset(g, 0, sizeof *g);
    g->s = s;
    atomic_init(&g->steps, 0);
    atomic_init(&g->stop, 0);
    atomic_init(&g->done, 0);
    KVT_EQ(pthread_create(&g->th, NULL, engine_main, g), 0);
}

static int wait_steps(engine *g, uint64_t at_least, uint64_t timeout_us)
{
    uint64_t until = of_now_us() + timeout_us;
    while (atomic_load(&g->steps) < at_least) {
        if (of_now_us() > until || atomic_load(&g->done)) return 0;
        of_sleep_us(200);
    }
    return 1;
}

/* Stops the engine and joins it: 1 when it ended within 10 s (if not, breakpoints are cleared and it is
 * resumed once more). 0: the thread is left running and nothing it uses may be freed. */
static int engine_finish(engine *g, kvs_bus *bus)
{
    atomic_store(&g->stop, 1);
    if (!wait_flag(&g->done, 10000000)) {
        fprintf(stderr, "  the engine thread did not finish within 10 s after resume\n");
        KVT_CHECK(0);
        kvs_bus_break_remove(bus, 0);
        kvs_bus_resume(bus);
        if (!wait_flag(&g->done, 5000000)) return 0;
    }
    pthread_join(g->th, NULL);
    KVT_EQ(g->errors, 0);
    return 1;
}

/* Reads the PAUSED / RESUMED events of a reader: counts, and the first PAUSED one. */
static void pause_events(kvs_reader *r, size_t *paused, size_t *resumed, kvs_event *first_paused, int *order_ok)
{
    kvs_event got[64];
    size_t n = 0;
    uint64_t first_p = 0, first_r = 0;
    *paused = *resumed = 0;
    KVT_EQ(kvs_reader_read(r, got, 64, &n, NULL), KVS_OK);
    for (size_t i = 0; i < n; i++) {
        if (got[i].kind == KVS_EV_PAUSED) {
            if (!(*paused)++) {
                first_p = got[i].seq;
                *first_paused = got[i];
            }
        } else if (got[i].kind == KVS_EV_RESUMED) {
            if (!(*resumed)++) first_r = got[i].seq;
        } else {
            KVT_CHECK(0); /* the reader asked for these two kinds only */
        }
    }
    *order_ok = first_p && first_r && first_p < first_r;
}

static void state_breakpoint_holds_the_engine_until_resumed(void)
{
    obs_env e;
    kvs_bus *bus = new_bus();
    kvs_reader *r = NULL;
    kvs_breakpoint bp;
    kvs_pause_info info, now;
    engine g;
    uint32_t id = 0;
    uint64_t before, after;
    size_t paused, resumed;
    kvs_event pev;
    int order_ok;
    obs_open(&e, 64, 0, bus);
    KVT_EQ(kvs_reader_open(bus, KVS_EV_MASK(KVS_EV_PAUSED) | KVS_EV_MASK(KVS_EV_RESUMED), 64, &r), KVS_OK);
    memset(&bp, 0, sizeof bp);
    bp.state = KVS_SLOT_DECODING;
    KVT_EQ(kvs_bus_break_add(bus, &bp, &id), KVS_OK);
    KVT_CHECK(id != 0);
    engine_start(&g, e.s);
    memset(&info, 0, sizeof info);
    KVT_EQ(kvs_bus_wait_paused(bus, 5000000, &info), KVS_OK);
    KVT_EQ(info.state, KVS_SLOT_DECODING);
    KVT_EQ(info.call, 0);
    KVT_CHECK(info.request != 0);
    memset(&now, 0, sizeof now);
    KVT_EQ(kvs_bus_paused(bus, &now), 1);
    KVT_EQ(now.state, info.state);
    KVT_EQ(now.request, info.request);
    before = atomic_load(&g.steps);
    of_sleep_us(50000);
    after = atomic_load(&g.steps);
    KVT_EQ(after, before); /* held */
    KVT_EQ(kvs_bus_paused(bus, NULL), 1);
    KVT_EQ(kvs_bus_break_remove(bus, id), KVS_OK);
    KVT_EQ(kvs_bus_break_remove(bus, id), KVS_ENOTFOUND);
    KVT_EQ(kvs_bus_resume(bus), KVS_OK);
    KVT_CHECK(wait_steps(&g, before + 20, 10000000)); /* runs again */
    if (!engine_finish(&g, bus)) return;
    pause_events(r, &paused, &resumed, &pev, &order_ok);
    KVT_EQ(paused, 1);
    KVT_EQ(resumed, 1);
    KVT_CHECK(order_ok);
    KVT_EQ(pev.u.pause.state, KVS_SLOT_DECODING);
    KVT_EQ(pev.request, info.request);
    kvs_reader_close(r);
    obs_close(&e);
    kvs_bus_destroy(bus);
}

static void request_breakpoint_stops_only_that_request(void)
{
    obs_env e;
    kvs_bus *bus = new_bus();
    kvs_breakpoint bp;
    kvs_pause_info info;
    engine g;
    uint32_t id = 0;
    obs_open(&e, 64, 0, bus);
    memset(&bp, 0, sizeof bp);
    bp.request = 3; /* the third request added (ids count from 1) */
    bp.state = KVS_SLOT_PREFILLING;
    KVT_EQ(kvs_bus_break_add(bus, &bp, &id), KVS_OK);
    engine_start(&g, e.s);
    memset(&info, 0, sizeof info);
    KVT_EQ(kvs_bus_wait_paused(bus, 5000000, &info), KVS_OK);
    KVT_EQ(info.request, 3);
    KVT_EQ(info.state, KVS_SLOT_PREFILLING);
    KVT_EQ(kvs_bus_break_remove(bus, 0), KVS_OK); /* 0: all */
    KVT_EQ(kvs_bus_resume(bus), KVS_OK);
    engine_finish(&g, bus);
    obs_close(&e);
    kvs_bus_destroy(bus);
}

static void call_breakpoint_stops_at_the_call(void)
{
    obs_env e;
    kvs_bus *bus = new_bus();
    kvs_breakpoint bp;
    kvs_pause_info info;
    engine g;
    uint32_t id = 0;
    obs_open(&e, 64, 0, bus);
    memset(&bp, 0, sizeof bp);
    bp.call = KVS_CALL_COMPLETE;
    KVT_EQ(kvs_bus_break_add(bus, &bp, &id), KVS_OK);
    engine_start(&g, e.s);
    memset(&info, 0, sizeof info);
    KVT_EQ(kvs_bus_wait_paused(bus, 5000000, &info), KVS_OK);
    KVT_EQ(info.call, KVS_CALL_COMPLETE);
    KVT_EQ(atomic_load(&g.steps), 0); /* before the first complete returned */
    KVT_EQ(kvs_bus_break_remove(bus, id), KVS_OK);
    KVT_EQ(kvs_bus_resume(bus), KVS_OK);
    KVT_CHECK(wait_steps(&g, 10, 10000000));
    engine_finish(&g, bus);
    obs_close(&e);
    kvs_bus_destroy(bus);
}

/* A breakpoint on a call and a state stops when a slot enters the state during that call, and only then
 * (the manual's "a combination"): before, a transition's checkpoint named no call, so such a breakpoint
 * never fired. One on a call alone still stops at the call, not at the transitions within it. */
static void call_and_state_breakpoint_stops_at_a_transition_in_that_call(void)
{
    obs_env e;
    kvs_bus *bus = new_bus();
    kvs_breakpoint bp;
    kvs_pause_info info;
    engine g;
    uint32_t never = 0, id = 0;
    obs_open(&e, 64, 0, bus);
    memset(&bp, 0, sizeof bp);
    bp.call = KVS_CALL_ABORT; /* the engine aborts only once told to stop */
    bp.state = KVS_SLOT_PREFILLING;
    KVT_EQ(kvs_bus_break_add(bus, &bp, &never), KVS_OK);
    bp.call = KVS_CALL_STEP; /* admission: Initialized -> Prefilling within a step */
    KVT_EQ(kvs_bus_break_add(bus, &bp, &id), KVS_OK);
    engine_start(&g, e.s);
    memset(&info, 0, sizeof info);
    KVT_EQ(kvs_bus_wait_paused(bus, 5000000, &info), KVS_OK);
    KVT_EQ(info.call, 0); /* a transition */
    KVT_EQ(info.state, KVS_SLOT_PREFILLING);
    KVT_CHECK(info.request != 0);
    KVT_EQ(atomic_load(&g.steps), 0); /* within the first step */
    KVT_EQ(kvs_bus_break_remove(bus, id), KVS_OK);
    KVT_EQ(kvs_bus_resume(bus), KVS_OK);
    KVT_CHECK(wait_steps(&g, 20, 10000000)); /* finishing and adding requests, none stops */
    KVT_EQ(kvs_bus_paused(bus, NULL), 0);
    KVT_EQ(kvs_bus_break_remove(bus, never), KVS_OK);
    engine_finish(&g, bus);
    obs_close(&e);
    kvs_bus_destroy(bus);
}

static void pause_stops_a_running_engine_at_its_next_call(void)
{
    obs_env e;
    kvs_bus *bus = new_bus();
    kvs_reader *r = NULL;
    kvs_pause_info info;
    engine g;
    uint64_t before, after;
    size_t paused, resumed;
    kvs_event pev;
    int order_ok;
    obs_open(&e, 64, 0, bus);
    KVT_EQ(kvs_reader_open(bus, KVS_EV_MASK(KVS_EV_PAUSED) | KVS_EV_MASK(KVS_EV_RESUMED), 64, &r), KVS_OK);
    engine_start(&g, e.s);
    KVT_CHECK(wait_steps(&g, 5, 5000000));
    KVT_EQ(kvs_bus_pause(bus), KVS_OK);
    memset(&info, 0, sizeof info);
    KVT_EQ(kvs_bus_wait_paused(bus, 5000000, &info), KVS_OK);
    /* "the next thread to reach a call or a slot transition stops there": the engine may be inside
     * kvs_sched_complete, so a slot transition (call 0, a state) is as right as a call */
    KVT_CHECK(info.call != 0 || info.state != 0);
    before = atomic_load(&g.steps);
    of_sleep_us(50000);
    after = atomic_load(&g.steps);
    KVT_EQ(after, before);
    KVT_EQ(kvs_bus_resume(bus), KVS_OK);
    KVT_CHECK(wait_steps(&g, before + 20, 10000000));
    if (!engine_finish(&g, bus)) return;
    pause_events(r, &paused, &resumed, &pev, &order_ok);
    KVT_EQ(paused, 1);
    KVT_EQ(resumed, 1);
    KVT_CHECK(order_ok);
    KVT_EQ(pev.u.pause.call, info.call);
    kvs_reader_close(r);
    obs_close(&e);
    kvs_bus_destroy(bus);
}

/* Paused before the engine starts: its first call (kvs_sched_add) is where it stops. */
static void pause_before_the_first_call_stops_at_it(void)
{
    obs_env e;
    kvs_bus *bus = new_bus();
    kvs_pause_info info;
    engine g;
    obs_open(&e, 64, 0, bus);
    KVT_EQ(kvs_bus_pause(bus), KVS_OK);
    engine_start(&g, e.s);
    memset(&info, 0, sizeof info);
    KVT_EQ(kvs_bus_wait_paused(bus, 5000000, &info), KVS_OK);
    KVT_EQ(info.call, KVS_CALL_ADD);
    KVT_EQ(kvs_bus_resume(bus), KVS_OK);
    KVT_CHECK(wait_steps(&g, 5, 10000000));
    engine_finish(&g, bus);
    obs_close(&e);
    kvs_bus_destroy(bus);
}

/* Once kvs_bus_resume returns, no thread is stopped: kvs_bus_paused says 0 and kvs_bus_wait_paused waits
 * for the next stop instead of reporting the one just resumed. */
static void resumed_thread_no_longer_counts_as_stopped(void)
{
    obs_env e;
    kvs_bus *bus = new_bus();
    engine g;
    int i, stale = 0, waited = 0;
    obs_open(&e, 64, 0, bus);
    engine_start(&g, e.s);
    KVT_CHECK(wait_steps(&g, 5, 5000000));
    for (i = 0; i < 50; i++) {
        KVT_EQ(kvs_bus_pause(bus), KVS_OK);
        if (kvs_bus_wait_paused(bus, 5000000, NULL) != KVS_OK) break;
        waited++;
        KVT_EQ(kvs_bus_resume(bus), KVS_OK);
        stale += kvs_bus_paused(bus, NULL);
    }
    KVT_EQ(waited, 50);
    if (stale) fprintf(stderr, "  %d of %d resumes still reported a thread stopped\n", stale, waited);
    KVT_EQ(stale, 0);
    kvs_bus_resume(bus);
    if (!engine_finish(&g, bus)) return;
    obs_close(&e);
    kvs_bus_destroy(bus);
}

static void wait_paused_with_nothing_running_times_out(void)
{
    kvs_bus *bus = new_bus();
    kvs_pause_info info;
    uint64_t t0 = of_now_us(), waited;
    KVT_EQ(kvs_bus_wait_paused(bus, 20000, &info), KVS_ETIMEDOUT);
    waited = of_now_us() - t0;
    KVT_CHECK(waited >= 10000);  /* it did wait */
    KVT_CHECK(waited < 5000000); /* and came back */
    KVT_EQ(kvs_bus_paused(bus, &info), 0);
    KVT_EQ(kvs_bus_wait_paused(bus, 0, NULL), KVS_ETIMEDOUT);
    kvs_bus_destroy(bus);
}

/* resume cancels a pause that no thread reached yet: a call on this very thread then does not stop
 * (if it did, the watchdog would end the program). */
static void resume_cancels_a_pause_not_reached(void)
{
    obs_env e;
    kvs_bus *bus = new_bus();
    kvs_request rq;
    uint32_t prompt[20];
    uint64_t id = 0;
    obs_open(&e, 16, 0, bus);
    KVT_EQ(kvs_bus_pause(bus), KVS_OK);
    KVT_EQ(kvs_bus_resume(bus), KVS_OK);
    memset(&rq, 0, sizeof rq);
    sf_tokens(4, prompt, 20);
    rq.prompt = prompt;
    rq.num_prompt = 20;
    rq.max_new_tokens = 2;
    KVT_EQ(kvs_sched_add(e.s, &rq, &id), KVS_OK);
    KVT_EQ(kvs_bus_paused(bus, NULL), 0);
    obs_close(&e);
    kvs_bus_destroy(bus);
}

static void breakpoint_all_zero_is_invalid(void)
{
    kvs_bus *bus = new_bus();
    kvs_breakpoint bp;
    uint32_t id = 0;
    memset(&bp, 0, sizeof bp);
    KVT_EQ(kvs_bus_break_add(bus, &bp, &id), KVS_EINVAL);
    KVT_EQ(kvs_bus_break_remove(bus, 12345), KVS_ENOTFOUND);
    KVT_EQ(kvs_bus_break_remove(bus, 0), KVS_OK); /* removing all of none */
    kvs_bus_destroy(bus);
}

typedef struct hook_rec {
    kvs_call call;
    int finished;
    uint64_t request;
    int result;
} hook_rec;

typedef struct hook_log {
    pthread_mutex_t mu;
    hook_rec *r;
    size_t n, cap;
} hook_log;

static void hook_note(void *user, kvs_call call, int finished, uint64_t request, int result)
{
    hook_log *h = (hook_log *)user;
    pthread_mutex_lock(&h->mu);
    if (h->n == h->cap) {
        size_t cap = h->cap ? h->cap * 2 : 256;
        hook_rec *r = (hook_rec *)realloc(h->r, cap * sizeof *r);
        if (r) {
            h->r = r;
            h->cap = cap;
        }
    }
    if (h->n < h->cap) {
        h->r[h->n].call = call;
        h->r[h->n].finished = finished;
        h->r[h->n].request = request;
        h->r[h->n].result = result;
        h->n++;
    }
    pthread_mutex_unlock(&h->mu);
}

/* Per call kind, will and finished alternate (single-threaded caller), will-calls carry result 0.
 * Returns how many will-calls of `call` there were (every one matched by its finished-call). */
static size_t check_pairs(const hook_log *h, kvs_call call, int want_result_ok)
{
    size_t will = 0, bad = 0;
    int open = 0;
    for (size_t i = 0; i < h->n; i++) {
        const hook_rec *r = &h->r[i];
        if (r->call != call) continue;
        if (!r->finished) {
            if (open || r->result != 0) bad++;
            open = 1;
            will++;
        } else {
            if (!open || (want_result_ok && r->result != 0)) bad++;
            open = 0;
        }
    }
    if (open) bad++;
    if (bad) fprintf(stderr, "  hooks of %s: %zu out of order or failed\n", kvs_call_name(call), bad);
    KVT_EQ(bad, 0);
    return will;
}

static void hooks_see_every_call_before_and_after(void)
{
    obs_env e;
    kvs_bus *bus = new_bus();
    hook_log h;
    wl_result res;
    size_t n_before;
    uint32_t tok = 5;
    memset(&h, 0, sizeof h);
    pthread_mutex_init(&h.mu, NULL);
    obs_open(&e, WL_DEVICE_BLOCKS, 0, bus);
    KVT_EQ(kvs_bus_set_hook(bus, hook_note, &h), KVS_OK);
    res = run_workload(e.s, 3);
    KVT_EQ(check_pairs(&h, KVS_CALL_STEP, 1), res.steps);
    KVT_EQ(check_pairs(&h, KVS_CALL_COMPLETE, 1), res.steps);
    KVT_EQ(check_pairs(&h, KVS_CALL_ADD, 1), res.adds);
    KVT_EQ(check_pairs(&h, KVS_CALL_APPEND, 1), res.appends);
    KVT_EQ(check_pairs(&h, KVS_CALL_FINISH, 1), res.finishes);
    KVT_EQ(check_pairs(&h, KVS_CALL_ABORT, 1), res.aborts);
    KVT_EQ(check_pairs(&h, KVS_CALL_RELEASE, 1), res.releases);
    /* a failing call: its finished-call carries the result */
    n_before = h.n;
    KVT_EQ(kvs_sched_append(e.s, 999999, &tok, 1), KVS_ENOTFOUND);
    KVT_EQ(h.n, n_before + 2);
    if (h.n == n_before + 2) {
        KVT_EQ(h.r[n_before].call, KVS_CALL_APPEND);
        KVT_EQ(h.r[n_before].finished, 0);
        KVT_EQ(h.r[n_before + 1].finished, 1);
        KVT_EQ(h.r[n_before + 1].result, KVS_ENOTFOUND);
        KVT_EQ(h.r[n_before + 1].request, 999999);
    }
    /* removed: nothing more */
    KVT_EQ(kvs_bus_set_hook(bus, NULL, NULL), KVS_OK);
    n_before = h.n;
    KVT_EQ(kvs_sched_append(e.s, 999999, &tok, 1), KVS_ENOTFOUND);
    KVT_EQ(h.n, n_before);
    obs_close(&e);
    kvs_bus_destroy(bus);
    free(h.r);
    pthread_mutex_destroy(&h.mu);
}

/* With tiers, the scheduler's connector calls are entry points too. */
/* A hook being removed from another thread while it runs: kvs_bus_set_hook returns only once the old
 * hook has returned, so its user data may be freed then (as kvo_manager_set_offloaded). */
typedef struct slow_hook { atomic_int entered, inside, calls_after; atomic_int removed; } slow_hook;

static void slow_hook_fn(void *user, kvs_call call, int finished, uint64_t request, int result)
{
    slow_hook *h = (slow_hook *)user;
    (void)call, (void)finished, (void)request, (void)result;
    if (atomic_load(&h->removed)) atomic_fetch_add(&h->calls_after, 1);
    atomic_store(&h->inside, 1);
    atomic_fetch_add(&h->entered, 1);
    of_sleep_us(200000);
    atomic_store(&h->inside, 0);
}

typedef struct append_job { kvs_sched *s; } append_job;

static void *append_once(void *arg)
{
    uint32_t tok = 5;
    (void)kvs_sched_append(((append_job *)arg)->s, 999999, &tok, 1); /* a failing call, hooked all the same */
    return NULL;
}

static void removing_a_hook_waits_out_the_call_in_progress(void)
{
    obs_env e;
    kvs_bus *bus = new_bus();
    slow_hook h;
    append_job job;
    pthread_t th;
    int i;
    memset(&h, 0, sizeof h);
    obs_open(&e, 8, 0, bus);
    KVT_EQ(kvs_bus_set_hook(bus, slow_hook_fn, &h), KVS_OK);
    job.s = e.s;
    KVT_EQ(pthread_create(&th, NULL, append_once, &job), 0);
    for (i = 0; i < 5000 && !atomic_load(&h.entered); i++) of_sleep_us(1000);
    KVT_CHECK(atomic_load(&h.entered));
    KVT_EQ(kvs_bus_set_hook(bus, NULL, NULL), KVS_OK);
    KVT_EQ(atomic_load(&h.inside), 0); /* the old hook has returned: h may go now */
    atomic_store(&h.removed, 1);
    pthread_join(th, NULL);
    KVT_EQ(atomic_load(&h.calls_after), 0);
    obs_close(&e);
    kvs_bus_destroy(bus);
}

/* Replacing a hook waits for the calls of the old hook only: before, it waited until no call of any hook
 * was in progress, so the new hook's calls from a busy engine kept it waiting (seconds), and a call of
 * the new hook that waited for the replacement to be over held it until that call gave up. */
typedef struct hook_swap { atomic_int old_in, old_go, new_in, swapped, new_gave_up; } hook_swap;

static void swap_old_hook(void *user, kvs_call call, int finished, uint64_t request, int result)
{
    hook_swap *h = (hook_swap *)user;
    (void)call, (void)finished, (void)request, (void)result;
    if (!atomic_exchange(&h->old_in, 1)) wait_flag(&h->old_go, 5000000); /* the first call holds until told */
}

static void swap_new_hook(void *user, kvs_call call, int finished, uint64_t request, int result)
{
    hook_swap *h = (hook_swap *)user;
    (void)call, (void)finished, (void)request, (void)result;
    if (!atomic_exchange(&h->new_in, 1) && !wait_flag(&h->swapped, 10000000)) atomic_store(&h->new_gave_up, 1);
}

typedef struct swap_job { kvs_bus *bus; hook_swap *h; } swap_job;

static void *swap_hooks(void *arg)
{
    swap_job *j = (swap_job *)arg;
    KVT_EQ(kvs_bus_set_hook(j->bus, swap_new_hook, j->h), KVS_OK);
    atomic_store(&j->h->swapped, 1);
    return NULL;
}

typedef struct append_loop { kvs_sched *s; atomic_int stop; } append_loop;

static void *append_until_stopped(void *arg)
{
    append_loop *l = (append_loop *)arg;
    uint32_t tok = 5;
    while (!atomic_load(&l->stop)) (void)kvs_sched_append(l->s, 999999, &tok, 1);
    return NULL;
}

static void replacing_a_hook_waits_for_the_old_one_only(void)
{
    obs_env e, busy;
    kvs_bus *bus = new_bus();
    hook_swap h;
    append_job one;
    append_loop loop;
    swap_job swap;
    pthread_t th_one, th_swap, th_loop;
    memset(&h, 0, sizeof h);
    obs_open(&e, 8, 0, bus);
    obs_open(&busy, 8, 0, bus); /* a second scheduler on the bus, calling all the time */
    KVT_EQ(kvs_bus_set_hook(bus, swap_old_hook, &h), KVS_OK);
    one.s = e.s;
    KVT_EQ(pthread_create(&th_one, NULL, append_once, &one), 0);
    KVT_CHECK(wait_flag(&h.old_in, 5000000)); /* a call of the old hook in progress */
    swap.bus = bus;
    swap.h = &h;
    KVT_EQ(pthread_create(&th_swap, NULL, swap_hooks, &swap), 0);
    loop.s = busy.s;
    atomic_init(&loop.stop, 0);
    KVT_EQ(pthread_create(&th_loop, NULL, append_until_stopped, &loop), 0);
    KVT_CHECK(wait_flag(&h.new_in, 5000000)); /* and one of the new hook */
    atomic_store(&h.old_go, 1);
    pthread_join(th_swap, NULL);
    pthread_join(th_one, NULL);
    atomic_store(&loop.stop, 1);
    pthread_join(th_loop, NULL);
    KVT_EQ(atomic_load(&h.swapped), 1);
    KVT_EQ(atomic_load(&h.new_gave_up), 0);
    KVT_EQ(kvs_bus_set_hook(bus, NULL, NULL), KVS_OK);
    obs_close(&busy);
    obs_close(&e);
    kvs_bus_destroy(bus);
}

static void hooks_see_connector_calls_with_tiers(void)
{
    sf_env e;
    sf_opts o;
    kvs_bus *bus = new_bus();
    kvs_sched_config sc;
    hook_log h;
    uint32_t prompt[64];
    memset(&h, 0, sizeof h);
    pthread_mutex_init(&h.mu, NULL);
    memset(&o, 0, sizeof o);
    o.device_blocks = 16;
    o.host_blocks = 32;
    sf_open(&e, &o);
    kvs_sched_destroy(e.s); /* the same scheduler again, on the bus */
    memset(&sc, 0, sizeof sc);
    sc.device = e.dev;
    sc.tiers = e.m;
    sc.bus = bus;
    e.s = NULL;
    KVT_EQ(kvs_sched_create(&sc, &e.s), KVS_OK);
    e.c = kvs_sched_connector(e.s);
    KVT_CHECK(e.c != NULL);
    KVT_EQ(kvs_bus_set_hook(bus, hook_note, &h), KVS_OK);
    sf_tokens(77, prompt, 64);
    sf_add(&e, prompt, 64, 4, 0);
    sf_run(&e, 100);
    KVT_EQ(sf_settle(&e), 0);
    KVT_CHECK(check_pairs(&h, KVS_CALL_BUILD_META, 1) >= 1);
    KVT_CHECK(check_pairs(&h, KVS_CALL_GET_NUM_NEW_MATCHED_TOKENS, 1) >= 1);
    KVT_CHECK(check_pairs(&h, KVS_CALL_NOTE_REGISTERED, 1) >= 1);
    KVT_CHECK(check_pairs(&h, KVS_CALL_START_STORES, 1) >= 1);
    KVT_CHECK(check_pairs(&h, KVS_CALL_GET_FINISHED, 1) >= 1);
    KVT_EQ(kvs_bus_set_hook(bus, NULL, NULL), KVS_OK);
    sf_close(&e);
    kvs_bus_destroy(bus);
    free(h.r);
    pthread_mutex_destroy(&h.mu);
}

/* =========================================================================================================
 * 6. metrics
 * ======================================================================================================= */

enum { PROM_MAX = 256 };

typedef struct prom_family {
    char name[128];
    int type;    /* 0 none, 1 counter, 2 gauge */
    int helped;
    int samples;
    int closed;  /* its group ended: another family's line came after it */
} prom_family;

typedef struct prom_sample {
    char name[128];
    char labels[256]; /* as written, between the braces */
    double value;
} prom_sample;

typedef struct prom_doc {
    prom_family fam[PROM_MAX];
    size_t nfam;
    prom_sample *s;
    size_t ns, caps;
    char error[256];
} prom_doc;

static int prom_fail(prom_doc *d, size_t line, const char *why, const char *text, size_t len)
{
    if (!d->error[0])
        snprintf(d->error, sizeof d->error, "line %zu: %s: %.*s", line, why, (int)(len > 120 ? 120 : len), text);
    return 0;
}

static int prom_name_start(char c) { return isalpha((unsigned char)c) || c == '_' || c == ':'; }
static int prom_name_char(char c) { return isalnum((unsigned char)c) || c == '_' || c == ':'; }
static int label_start(char c) { return isalpha((unsigned char)c) || c == '_'; }
static int label_char(char c) { return isalnum((unsigned char)c) || c == '_'; }

/* Reads a metric name at *p (up to end); its length, 0 when none. */
static size_t prom_name(const char *p, const char *end)
{
    size_t n = 0;
    if (p >= end || !prom_name_start(*p)) return 0;
    while (p + n < end && prom_name_char(p[n])) n++;
    return n;
}

/* The family of name (created when new, *current tells which family the previous line was about). */
static prom_family *prom_family_of(prom_doc *d, const char *name, size_t len, prom_family **current, size_t line,
                                   const char *text, size_t tlen)
{
    prom_family *f = NULL;
    for (size_t i = 0; i < d->nfam; i++)
        if (strlen(d->fam[i].name) == len && !memcmp(d->fam[i].name, name, len)) f = &d->fam[i];
    if (!f) {
        if (d->nfam == PROM_MAX || len >= sizeof d->fam[0].name) {
            prom_fail(d, line, "too many families or too long a name", text, tlen);
            return NULL;
        }
        f = &d->fam[d->nfam++];
        memset(f, 0, sizeof *f);
        memcpy(f->name, name, len);
    }
    if (*current && *current != f) (*current)->closed = 1;
    if (f->closed) {
        prom_fail(d, line, "the family's lines are not one group", text, tlen);
        return NULL;
    }
    *current = f;
    return f;
}

/* Label set {a="x",b="y"} at *p; advances *p past the closing brace. */
static int prom_labels(prom_doc *d, const char **pp, const char *end, size_t line, const char *text, size_t tlen)
{
    const char *p = *pp + 1;
    char seen[16][64];
    size_t nseen = 0;
    for (;;) {
        size_t n = 0;
        while (p < end && *p == ' ') p++;
        if (p < end && *p == '}') break;
        if (p >= end || !label_start(*p)) return prom_fail(d, line, "bad label name", text, tlen);
        while (p + n < end && label_char(p[n])) n++;
        if (n >= 64 || nseen == 16) return prom_fail(d, line, "label name too long or too many", text, tlen);
        for (size_t i = 0; i < nseen; i++)
            if (strlen(seen[i]) == n && !memcmp(seen[i], p, n)) return prom_fail(d, line, "label twice", text, tlen);
        memcpy(seen[nseen], p, n);
        seen[nseen++][n] = 0;
        if (n >= 2 && p[0] == '_' && p[1] == '_') return prom_fail(d, line, "reserved label name", text, tlen);
        p += n;
        if (p >= end || *p != '=') return prom_fail(d, line, "label without =", text, tlen);
        p++;
        if (p >= end || *p != '"') return prom_fail(d, line, "label value not quoted", text, tlen);
        p++;
        while (p < end && *p != '"') {
            if (*p == '\\') {
                if (p + 1 >= end || (p[1] != '\\' && p[1] != '"' && p[1] != 'n'))
                    return prom_fail(d, line, "bad escape in label value", text, tlen);
                p++;
            }
            p++;
        }
        if (p >= end) return prom_fail(d, line, "unterminated label value", text, tlen);
        p++;
        while (p < end && *p == ' ') p++;
        if (p < end && *p == ',') {
            p++;
            continue;
        }
        if (p < end && *p == '}') break;
        return prom_fail(d, line, "expected , or } in labels", text, tlen);
    }
    *pp = p + 1;
    return 1;
}

static int prom_number(const char *p, size_t n, double *out)
{
    char buf[64];
    char *endp;
    if (!n || n >= sizeof buf) return 0;
    memcpy(buf, p, n);
    buf[n] = 0;
    if (!strcmp(buf, "NaN")) return *out = NAN, 1;
    if (!strcmp(buf, "+Inf")) return *out = INFINITY, 1;
    if (!strcmp(buf, "-Inf")) return *out = -INFINITY, 1;
    for (size_t i = 0; i < n; i++)
        if (!isdigit((unsigned char)buf[i]) && !strchr("+-.eE", buf[i])) return 0;
    *out = strtod(buf, &endp);
    return *endp == 0;
}

static int prom_sample_line(prom_doc *d, const char *p, const char *end, prom_family **cur, size_t line)
{
    const char *text = p, *lab = NULL, *num;
    size_t tlen = (size_t)(end - p), n = prom_name(p, end), lablen = 0;
    prom_family *f;
    prom_sample *s;
    double v;
    if (!n) return prom_fail(d, line, "bad metric name", text, tlen);
    if (n < 8 || memcmp(p, "kvcache_", 8)) return prom_fail(d, line, "name without the kvcache_ prefix", text, tlen);
    if (!(f = prom_family_of(d, p, n, cur, line, text, tlen))) return 0;
    if (!f->type) return prom_fail(d, line, "sample before its # TYPE line", text, tlen);
    p += n;
    if (p < end && *p == '{') {
        lab = p + 1;
        if (!prom_labels(d, &p, end, line, text, tlen)) return 0;
        lablen = (size_t)(p - 1 - lab);
    }
    if (p >= end || *p != ' ') return prom_fail(d, line, "no space before the value", text, tlen);
    while (p < end && *p == ' ') p++;
    num = p;
    while (p < end && *p != ' ') p++;
    if (!prom_number(num, (size_t)(p - num), &v)) return prom_fail(d, line, "bad value", text, tlen);
    if (p < end) { /* an optional timestamp */
        const char *ts;
        while (p < end && *p == ' ') p++;
        ts = p;
        if (p < end && *p == '-') p++;
        while (p < end && isdigit((unsigned char)*p)) p++;
        if (p != end || p == ts) return prom_fail(d, line, "junk after the value", text, tlen);
    }
    if (f->type == 1 && !(v >= 0)) return prom_fail(d, line, "negative or NaN counter", text, tlen);
    if (lablen >= sizeof s->labels) return prom_fail(d, line, "labels too long", text, tlen);
    for (size_t i = 0; i < d->ns; i++)
        if (!strcmp(d->s[i].name, f->name) && strlen(d->s[i].labels) == lablen && !memcmp(d->s[i].labels, lab, lablen))
            return prom_fail(d, line, "the same series twice", text, tlen);
    if (d->ns == d->caps) {
        size_t cap = d->caps ? d->caps * 2 : 64;
        prom_sample *ns = (prom_sample *)realloc(d->s, cap * sizeof *ns);
        if (!ns) return prom_fail(d, line, "out of memory", text, tlen);
        d->s = ns;
        d->caps = cap;
    }
    s = &d->s[d->ns++];
    memset(s, 0, sizeof *s);
    memcpy(s->name, f->name, strlen(f->name));
    if (lablen) memcpy(s->labels, lab, lablen);
    s->value = v;
    f->samples++;
    return 1;
}

static int prom_comment_line(prom_doc *d, const char *p, const char *end, prom_family **cur, size_t line)
{
    const char *text = p;
    size_t tlen = (size_t)(end - p), n;
    int help;
    prom_family *f;
    if (tlen > 7 && !memcmp(p, "# HELP ", 7)) help = 1;
    else if (tlen > 7 && !memcmp(p, "# TYPE ", 7)) help = 0;
    else return prom_fail(d, line, "a comment that is neither # HELP nor # TYPE", text, tlen);
    p += 7;
    n = prom_name(p, end);
    if (!n) return prom_fail(d, line, "bad metric name", text, tlen);
    if (n < 8 || memcmp(p, "kvcache_", 8)) return prom_fail(d, line, "name without the kvcache_ prefix", text, tlen);
    if (!(f = prom_family_of(d, p, n, cur, line, text, tlen))) return 0;
    p += n;
    if (help) {
        if (f->helped) return prom_fail(d, line, "second # HELP", text, tlen);
        if (f->samples) return prom_fail(d, line, "# HELP after samples", text, tlen);
        f->helped = 1;
        if (p < end && *p != ' ') return prom_fail(d, line, "no space after the name", text, tlen);
        for (; p < end; p++)
            if (*p == '\\' && (p + 1 >= end || (p[1] != '\\' && p[1] != 'n')))
                return prom_fail(d, line, "bad escape in help", text, tlen);
            else if (*p == '\\')
                p++;
        return 1;
    }
    if (f->type) return prom_fail(d, line, "second # TYPE", text, tlen);
    if (f->samples) return prom_fail(d, line, "# TYPE after samples", text, tlen);
    if (end - p == 8 && !memcmp(p, " counter", 8)) f->type = 1;
    else if (end - p == 6 && !memcmp(p, " gauge", 6)) f->type = 2;
    else return prom_fail(d, line, "type neither counter nor gauge", text, tlen);
    return 1;
}

/* 1 when text is valid Prometheus text exposition (0.0.4) as described in section 6 of the brief. */
static int prom_parse(prom_doc *d, const char *text, size_t len)
{
    const char *p = text, *end = text + len;
    prom_family *cur = NULL;
    size_t line = 0;
    memset(d->fam, 0, sizeof d->fam);
    d->nfam = 0;
    d->ns = 0;
    d->error[0] = 0;
    if (!len || text[len - 1] != '\n') return prom_fail(d, 0, "does not end with a line feed", text, 0);
    while (p < end) {
        const char *eol = memchr(p, '\n', (size_t)(end - p));
        int ok;
        line++;
        if (!eol) eol = end;
        if (eol == p) ok = 1; /* empty line */
        else if (*p == '#') ok = prom_comment_line(d, p, eol, &cur, line);
        else ok = prom_sample_line(d, p, eol, &cur, line);
        if (!ok) return 0;
        for (const char *q = p; q < eol; q++)
            if (*q == '\r' || *q == '\t' || *q == 0) return prom_fail(d, line, "control character", p, (size_t)(eol - p));
        p = eol + 1;
    }
    for (size_t i = 0; i < d->nfam; i++)
        if (!d->fam[i].samples) {
            /* a family announced without samples is allowed by the format; nothing to check */
        }
    return 1;
}

static const char *prom_self_test_bad[] = {
    "kvcache_x 1\n",                                             /* no TYPE */
    "# TYPE kvcache_x counter\n# TYPE kvcache_x counter\nkvcache_x 1\n",
    "# TYPE kvcache_x counter\nkvcache_x{tier=0} 1\n",           /* unquoted */
    "# TYPE kvcache_x counter\nkvcache_x{tier=\"0\"} one\n",
    "# TYPE kvcache_x gauge\nkvcache_x 1\n# TYPE kvcache_y gauge\nkvcache_y 1\nkvcache_x 2\n", /* split group */
    "# TYPE x gauge\nx 1\n",                                     /* prefix */
    "# TYPE kvcache_x summary\nkvcache_x 1\n",
    "# TYPE kvcache_x gauge\nkvcache_x 1",                        /* no final line feed */
    "# TYPE kvcache_x gauge\nkvcache_x{tier=\"0\",tier=\"1\"} 1\n",
    "# TYPE kvcache_x gauge\nkvcache_x{tier=\"a\\q\"} 1\n",
    "# TYPE kvcache_x counter\nkvcache_x -1\n",
    "# just a comment\n",
};

/* The validator itself: accepts a good document, rejects each bad one. */
static void metrics_validator_knows_good_from_bad(void)
{
    static const char good[] = "# HELP kvcache_hits_total Blocks found. Tier \\\\ \\n ok\n"
                               "# TYPE kvcache_hits_total counter\n"
                               "kvcache_hits_total{tier=\"0\"} 12\n"
                               "kvcache_hits_total{tier=\"1\",direction=\"a\\\"b\"} 3\n"
                               "\n"
                               "# TYPE kvcache_used gauge\n"
                               "kvcache_used 1.5e3\n";
    prom_doc *d = (prom_doc *)calloc(1, sizeof *d);
    if (!d) return;
    KVT_CHECK(prom_parse(d, good, strlen(good)));
    if (d->error[0]) fprintf(stderr, "  %s\n", d->error);
    KVT_EQ(d->ns, 3);
    for (size_t i = 0; i < sizeof prom_self_test_bad / sizeof prom_self_test_bad[0]; i++) {
        int ok = prom_parse(d, prom_self_test_bad[i], strlen(prom_self_test_bad[i]));
        if (ok) fprintf(stderr, "  accepted bad document %zu\n", i);
        KVT_CHECK(!ok);
    }
    free(d->s);
    free(d);
}

static int has_label(const prom_sample *s, const char *label)
{
    return strstr(s->labels, label) != NULL;
}

static char *metrics_text(kvs_sched *s, size_t *len)
{
    char probe[16];
    size_t need = 0, got = 0;
    char *buf;
    KVT_EQ(kvs_metrics_write(s, NULL, probe, sizeof probe, &need), KVS_ENOSPACE);
    KVT_CHECK(need > sizeof probe);
    buf = (char *)malloc(need + 1);
    if (!buf) return NULL;
    KVT_EQ(kvs_metrics_write(s, NULL, buf, need + 1, &got), KVS_OK);
    KVT_CHECK(got == need || got + 1 == need); /* the same size, whether or not "needed" counts the NUL */
    KVT_EQ(strlen(buf), got);
    *len = got;
    return buf;
}

static void metrics_are_valid_prometheus_text(void)
{
    obs_env e;
    size_t len = 0;
    char *text;
    prom_doc *d = (prom_doc *)calloc(1, sizeof *d);
    if (!d) return;
    obs_open(&e, WL_DEVICE_BLOCKS, 0, NULL);
    run_workload(e.s, 4);
    text = metrics_text(e.s, &len);
    KVT_CHECK(text != NULL);
    if (text) {
        int ok = prom_parse(d, text, len);
        if (!ok) fprintf(stderr, "  %s\n", d->error);
        KVT_CHECK(ok);
        KVT_CHECK(d->ns >= 5);
    }
    free(text);
    free(d->s);
    free(d);
    obs_close(&e);
}

static void metrics_count_what_the_stats_count(void)
{
    obs_env e;
    size_t len = 0, hit_series = 0, step_series = 0;
    char *text;
    kvb_pool_stats ps;
    kvs_sched_stats ss;
    prom_doc *d = (prom_doc *)calloc(1, sizeof *d);
    if (!d) return;
    obs_open(&e, WL_DEVICE_BLOCKS, 0, NULL);
    run_workload(e.s, 4);
    KVT_EQ(kvb_pool_get_stats(e.dev, &ps), KVB_OK);
    KVT_EQ(kvs_sched_get_stats(e.s, &ss), KVS_OK);
    KVT_CHECK(ps.hit_blocks > 0);
    text = metrics_text(e.s, &len);
    if (text && prom_parse(d, text, len)) {
        for (size_t i = 0; i < d->ns; i++) {
            const prom_sample *s = &d->s[i];
            if (strstr(s->name, "hit") && has_label(s, "tier=\"0\"")) {
                if (strstr(s->name, "hit_blocks")) {
                    KVT_EQ((uint64_t)s->value, ps.hit_blocks);
                    hit_series++;
                } else if (strstr(s->name, "hit_tokens")) {
                    int same = (uint64_t)s->value == ps.hit_tokens || (uint64_t)s->value == ss.cached_tokens;
                    if (!same)
                        fprintf(stderr, "  %s{%s} = %.0f; pool hit_tokens %" PRIu64 ", sched cached_tokens %" PRIu64 "\n",
                                s->name, s->labels, s->value, ps.hit_tokens, ss.cached_tokens);
                    KVT_CHECK(same);
                    hit_series++;
                }
            }
            if (strstr(s->name, "steps") && !s->labels[0]) {
                KVT_EQ((uint64_t)s->value, ss.steps);
                step_series++;
            }
        }
    } else {
        fprintf(stderr, "  not valid: %s\n", d->error);
        KVT_CHECK(0);
    }
    if (!hit_series) fprintf(stderr, "  no *hit_blocks* or *hit_tokens* series with tier=\"0\"\n%s", text ? text : "");
    KVT_CHECK(hit_series >= 1);
    KVT_CHECK(step_series >= 1);
    free(text);
    free(d->s);
    free(d);
    obs_close(&e);
}

/* With a host and a disk tier: every pool gets its tier label, the pipelines their direction, and the
 * disk backend adds its own counters; the document stays valid. */
static void metrics_with_tiers_and_disk_are_valid_prometheus_text(void)
{
    sf_env e;
    sf_opts o;
    kvs_sched_config sc;
    uint32_t prompt[96];
    size_t len = 0, tier_seen[3] = {0}, direction = 0, checksum = 0, joined = 0;
    char *text;
    prom_doc *d = (prom_doc *)calloc(1, sizeof *d);
    if (!d) return;
    memset(&o, 0, sizeof o);
    o.device_blocks = 16;
    o.host_blocks = 32;
    o.disk_blocks = 64;
    sf_open(&e, &o);
    kvs_sched_destroy(e.s); /* the same scheduler on a config that metrics may read the tiers from */
    memset(&sc, 0, sizeof sc);
    sc.device = e.dev;
    sc.tiers = e.m;
    e.s = NULL;
    KVT_EQ(kvs_sched_create(&sc, &e.s), KVS_OK);
    e.c = kvs_sched_connector(e.s);
    for (int i = 0; i < 4; i++) {
        sf_tokens(300 + (uint64_t)i, prompt, 96);
        sf_add(&e, prompt, 96, 4, 0);
    }
    sf_run(&e, 200);
    KVT_EQ(sf_settle(&e), 0);
    {
        char probe[8];
        size_t need = 0;
        KVT_EQ(kvs_metrics_write(e.s, e.diskb, probe, sizeof probe, &need), KVS_ENOSPACE);
        text = (char *)malloc(need + 1);
        if (text) KVT_EQ(kvs_metrics_write(e.s, e.diskb, text, need + 1, &len), KVS_OK);
    }
    if (text) {
        int ok = prom_parse(d, text, len);
        if (!ok) fprintf(stderr, "  %s\n", d->error);
        KVT_CHECK(ok);
        for (size_t i = 0; ok && i < d->ns; i++) {
            static const char *tiers[3] = {"tier=\"0\"", "tier=\"1\"", "tier=\"2\""};
            for (int t = 0; t < 3; t++)
                if (has_label(&d->s[i], tiers[t])) tier_seen[t]++;
            if (has_label(&d->s[i], "direction=\"")) direction++;
            if (strstr(d->s[i].name, "checksum")) {
                KVT_CHECK(has_label(&d->s[i], "tier=\"2\"")); /* the disk's tier */
                checksum++;
            }
            if (strcmp(d->s[i].name, "kvcache_onboard_joined_blocks_total") == 0) { /* G2 and G3 -> G1 */
                kvo_manager_stats ms;
                uint32_t t = has_label(&d->s[i], "tier=\"1\"") ? 1 : 2;
                KVT_EQ(kvo_manager_get_stats(e.m, &ms), KVO_OK);
                KVT_EQ((uint64_t)d->s[i].value, ms.up[t].joined);
                joined++;
            }
        }
        KVT_EQ(checksum, 1);
        KVT_EQ(joined, 2);
        KVT_CHECK(tier_seen[0] && tier_seen[1] && tier_seen[2]);
        KVT_CHECK(direction > 0);
    }
    free(text);
    free(d->s);
    free(d);
    sf_close(&e);
}

/* The tier label is the pool's place in the scheduler's chain (0 the device, then each down pipeline's
 * destination), as on the pipelines' series: before, pools were labelled by kvb_pool_config.tier, so a
 * host pool left at the default 0 gave every pool family the series tier="0" twice (not valid text),
 * and a host pool configured as tier 3 was tier="3" on its pool series and tier="1" on its pipelines'. */
static void metrics_label_pools_by_their_place_in_the_chain(void)
{
    for (uint32_t host_tier = 0; host_tier <= 3; host_tier += 3) {
        kvb_pool *dev = sf__pool(16, 0, KVB_LAYOUT_BLOCK_CONTIGUOUS, 0);
        kvb_pool *host = sf__pool(32, 1, KVB_LAYOUT_LAYER_SEPARATE, host_tier);
        kvo_backend *mem = NULL;
        kvo_manager *m = NULL;
        kvs_sched_config sc;
        kvs_sched *s = NULL;
        size_t len = 0, host_series = 0, pipe_series = 0;
        char *text;
        prom_doc *d = (prom_doc *)calloc(1, sizeof *d);
        of_memcpy_tiers(dev, host, &mem, &m);
        memset(&sc, 0, sizeof sc);
        sc.device = dev;
        sc.tiers = m;
        KVT_EQ(kvs_sched_create(&sc, &s), KVS_OK);
        text = d && s ? metrics_text(s, &len) : NULL;
        if (text) {
            int ok = prom_parse(d, text, len);
            if (!ok) fprintf(stderr, "  host pool of tier %u: %s\n", host_tier, d->error);
            KVT_CHECK(ok);
            for (size_t i = 0; ok && i < d->ns; i++) {
                if (strcmp(d->s[i].name, "kvcache_capacity_blocks") == 0 && has_label(&d->s[i], "tier=\"1\"")) {
                    KVT_EQ((uint64_t)d->s[i].value, 32);
                    host_series++;
                }
                if (strcmp(d->s[i].name, "kvcache_transfer_blocks_total") == 0)
                    pipe_series += has_label(&d->s[i], "tier=\"1\"");
            }
            KVT_EQ(host_series, 1);
            KVT_EQ(pipe_series, 2); /* offload into G2, onboard from it */
        }
        free(text);
        if (d) free(d->s);
        free(d);
        kvs_sched_destroy(s);
        kvo_manager_destroy(m);
        kvo_backend_destroy(mem);
        kvb_pool_destroy(host);
        kvb_pool_destroy(dev);
    }
}

static void metrics_into_a_short_buffer_say_how_much_is_needed(void)
{
    obs_env e;
    char small[32], *buf;
    size_t need = 0, got = 0, need2 = 0;
    obs_open(&e, WL_DEVICE_BLOCKS, 0, NULL);
    run_workload(e.s, 5);
    memset(small, 'x', sizeof small);
    KVT_EQ(kvs_metrics_write(e.s, NULL, small, sizeof small, &need), KVS_ENOSPACE);
    KVT_CHECK(need > sizeof small);
    buf = (char *)malloc(need + 1);
    if (buf) {
        KVT_EQ(kvs_metrics_write(e.s, NULL, buf, need + 1, &got), KVS_OK);
        KVT_EQ(strlen(buf), got);
        KVT_CHECK(got <= need);
        /* a buffer one byte short of what was said is too small again, and says the same */
        if (got) {
            KVT_EQ(kvs_metrics_write(e.s, NULL, buf, got, &need2), KVS_ENOSPACE);
            KVT_EQ(need2, need);
        }
    }
    free(buf);
    obs_close(&e);
}

/* A scheduler on a bus also exports how many events the bus has published (the bus's sequence; events
 * are published only while someone subscribes: here a recorder). */
static void metrics_count_the_bus_events(void)
{
    obs_env e;
    kvs_bus *bus = new_bus();
    kvs_recorder *rec = new_recorder(bus, NULL);
    char *buf = NULL;
    size_t need = 0, got = 0;
    char probe[8];
    obs_open(&e, WL_DEVICE_BLOCKS, 0, bus);
    run_workload(e.s, 6);
    KVT_EQ(kvs_metrics_write(e.s, NULL, probe, sizeof probe, &need), KVS_ENOSPACE);
    buf = (char *)malloc(need + 1);
    KVT_CHECK(buf != NULL);
    if (buf) {
        KVT_EQ(kvs_metrics_write(e.s, NULL, buf, need + 1, &got), KVS_OK);
        const char *line = strstr(buf, "\nkvcache_events_total ");
        KVT_CHECK(line != NULL);
        KVT_CHECK(strstr(buf, "# TYPE kvcache_events_total counter") != NULL);
        if (line) {
            unsigned long long total = strtoull(line + strlen("\nkvcache_events_total "), NULL, 10);
            KVT_CHECK(total > 100); /* a whole workload's steps, slots and inputs */
        }
    }
    free(buf);
    obs_close(&e);
    obs_open(&e, WL_DEVICE_BLOCKS, 0, NULL); /* no bus: no such family */
    KVT_EQ(kvs_metrics_write(e.s, NULL, probe, sizeof probe, &need), KVS_ENOSPACE);
    buf = (char *)malloc(need + 1);
    if (buf) {
        KVT_EQ(kvs_metrics_write(e.s, NULL, buf, need + 1, &got), KVS_OK);
        KVT_CHECK(strstr(buf, "kvcache_events_total") == NULL);
    }
    free(buf);
    obs_close(&e);
    kvs_recorder_destroy(rec);
    kvs_bus_destroy(bus);
}

/* The pool metrics_between_passes looks up in, and how many unknown hashes (0: it does nothing). */
static kvb_pool *moving_pool;
static size_t moving_lookups;

static void metrics_between_passes(void)
{
    kvb_hash *h;
    kvb_block none[1];
    size_t got = 0;
    if (!moving_pool || !moving_lookups) return;
    h = (kvb_hash *)calloc(moving_lookups, sizeof *h); /* hash 0 is never registered: a miss at once */
    if (h) KVT_EQ(kvb_match(moving_pool, h, moving_lookups, none, &got), KVB_OK);
    KVT_EQ(got, 0);
    free(h);
}

static unsigned digits(uint64_t v)
{
    unsigned n = 1;
    while (v >= 10) v /= 10, n++;
    return n;
}

/* A counter gains a digit between kvs_metrics_write's measuring pass and its writing pass (a lookup at
 * the seam, as another thread's would be): the buffer sized by the probe still gets the whole text, of
 * the length returned, valid to its last line feed. Both passes render one reading of the counters; when
 * each read them anew, the text came out one byte short, with KVS_OK. The next call reads the moved
 * counter: the same buffer is then too small, and says so. */
static void metrics_text_is_whole_when_a_counter_gains_a_digit(void)
{
    obs_env e;
    kvb_pool_stats before, after;
    size_t need = 0, got = 0, need2 = 0;
    char *buf;
    prom_doc *d = (prom_doc *)calloc(1, sizeof *d);
    if (!d) return;
    obs_open(&e, WL_DEVICE_BLOCKS, 0, NULL);
    run_workload(e.s, 7);
    KVT_EQ(kvs_metrics_write(e.s, NULL, NULL, 0, &need), KVS_ENOSPACE);
    buf = (char *)malloc(need + 1);
    KVT_CHECK(buf != NULL);
    KVT_EQ(kvb_pool_get_stats(e.dev, &before), KVB_OK);
    moving_pool = e.dev;
    moving_lookups = 1;
    for (unsigned k = digits(before.lookup_blocks); k--;) moving_lookups *= 10;
    moving_lookups -= (size_t)before.lookup_blocks; /* lookup_blocks_total{tier="0"} reaches 10^digits */
    if (buf) KVT_EQ(kvs_metrics_write(e.s, NULL, buf, need + 1, &got), KVS_OK);
    moving_pool = NULL;
    KVT_EQ(kvb_pool_get_stats(e.dev, &after), KVB_OK);
    KVT_EQ(digits(after.lookup_blocks), digits(before.lookup_blocks) + 1); /* the seam ran */
    if (buf) {
        KVT_EQ(got, need);
        KVT_EQ(strlen(buf), got);
        int ok = prom_parse(d, buf, strlen(buf));
        if (!ok) fprintf(stderr, "  %s\n", d->error);
        KVT_CHECK(ok);
        KVT_CHECK(strstr(buf, "kvcache_lookup_blocks_total{tier=\"0\"} ") != NULL);
        KVT_EQ(kvs_metrics_write(e.s, NULL, buf, need + 1, &need2), KVS_ENOSPACE);
        KVT_CHECK(need2 > need);
    }
    free(buf);
    free(d->s);
    free(d);
    obs_close(&e);
}

typedef struct lookup_job {
    kvb_pool *pool;
    atomic_int stop;
    uint64_t calls;
} lookup_job;

/* Prefix lookups that all miss, as fast as they go, until told to stop. */
static void *lookups_until_stopped(void *arg)
{
    lookup_job *job = (lookup_job *)arg;
    kvb_hash h[64];
    kvb_block none[1];
    memset(h, 0, sizeof h);
    while (!atomic_load(&job->stop)) {
        size_t got = 0;
        kvb_match(job->pool, h, 1 + job->calls % 64, none, &got);
        job->calls++;
    }
    return NULL;
}

/* While another thread looks up in the device pool, every text kvs_metrics_write returns KVS_OK for is
 * whole: of the length it says, valid Prometheus text. Under ThreadSanitizer, the counters are read under
 * their locks. */
static void metrics_text_is_whole_while_another_thread_counts(void)
{
    obs_env e;
    lookup_job job;
    pthread_t th;
    size_t whole = 0;
    prom_doc *d = (prom_doc *)calloc(1, sizeof *d);
    if (!d) return;
    obs_open(&e, WL_DEVICE_BLOCKS, 0, NULL);
    run_workload(e.s, 8);
    memset(&job, 0, sizeof job);
    job.pool = e.dev;
    atomic_init(&job.stop, 0);
    KVT_EQ(pthread_create(&th, NULL, lookups_until_stopped, &job), 0);
    for (int i = 0; i < 200; i++) {
        size_t need = 0, got = 0;
        char *buf;
        kvs_result r;
        KVT_EQ(kvs_metrics_write(e.s, NULL, NULL, 0, &need), KVS_ENOSPACE);
        if (!(buf = (char *)malloc(need + 1))) break;
        r = kvs_metrics_write(e.s, NULL, buf, need + 1, &got);
        KVT_CHECK(r == KVS_OK || r == KVS_ENOSPACE); /* a counter may gain a digit between the two calls */
        if (r == KVS_OK) {
            int ok = strlen(buf) == got && prom_parse(d, buf, got);
            if (!ok) fprintf(stderr, "  call %d: %zu bytes said, %zu written: %s\n", i, got, strlen(buf), d->error);
            KVT_CHECK(ok);
            whole++;
        } else {
            KVT_CHECK(got > need);
        }
        free(buf);
    }
    atomic_store(&job.stop, 1);
    KVT_EQ(pthread_join(th, NULL), 0);
    KVT_CHECK(whole > 0);
    KVT_CHECK(job.calls > 0);
    free(d->s);
    free(d);
    obs_close(&e);
}

/* =========================================================================================================
 * 7. bad input
 * ======================================================================================================= */

/* A console client's line longer than the console reads (255 bytes) is dropped whole: what follows
 * its 255th byte is not taken for a command of its own. */
static void console_drops_an_overlong_line_whole(void)
{
    kvs_bus *bus = new_bus();
    kvs_console *con = NULL;
    kvs_console_config cc;
    struct sockaddr_un addr;
    char path[64], line[300];
    int fd, i, pending = -1, armed = 0;
    snprintf(path, sizeof path, "/tmp/kvs_obs_console_%d.sock", (int)getpid());
    memset(&cc, 0, sizeof cc);
    cc.path = path;
    KVT_EQ(kvs_console_start(bus, &cc, &con), KVS_OK);
    if (!con) return;
    fd = socket(AF_UNIX, SOCK_STREAM, 0);
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    memcpy(addr.sun_path, path, strlen(path));
    KVT_EQ(connect(fd, (struct sockaddr *)&addr, sizeof addr), 0);
    memset(line, 'A', 256); /* 256 bytes of garbage, then "pause": one line, not a command */
    memcpy(line + 256, "pause\n", 6);
    KVT_EQ(send(fd, line, 262, MSG_NOSIGNAL), 262);
    KVT_EQ(send(fd, "break request 4242\n", 19, MSG_NOSIGNAL), 19); /* then a real one, to know both were read */
    for (i = 0; i < 5000 && !armed; i++) {
        armed = kvs__is_armed(&bus->armed);
        if (!armed) of_sleep_us(1000);
    }
    KVT_CHECK(armed);
    pthread_mutex_lock(&bus->lock);
    pending = bus->pause_pending;
    pthread_mutex_unlock(&bus->lock);
    KVT_EQ(pending, 0);
    close(fd);
    kvs_console_stop(con);
    kvs_bus_destroy(bus);
}

/* A refused release (the request is not Finished) is published like every input, but the request lives
 * on: the console keeps its live slot for the clients that attach later. With a history of one event,
 * a new client's first record after the header is then that slot, not the refused release. */
static void console_keeps_the_slot_of_a_refused_release(void)
{
    kvs_bus *bus = new_bus();
    kvs_console *con = NULL;
    kvs_console_config cc;
    obs_env e;
    char path[64];
    unsigned char buf[KVS_LOG_HEADER_BYTES + KVS_RECORD_BYTES];
    uint32_t prompt[20];
    uint64_t id = 0;
    kvs_event got;
    int fd, i, pumped = 0;
    for (uint32_t k = 0; k < 20; k++) prompt[k] = k;
    snprintf(path, sizeof path, "/tmp/kvs_obs_release_%d.sock", (int)getpid());
    memset(&cc, 0, sizeof cc);
    cc.path = path;
    cc.history = 1;
    KVT_EQ(kvs_console_start(bus, &cc, &con), KVS_OK);
    if (!con) return;
    obs_open(&e, 4, 0, bus);
    kvs_request rq;
    memset(&rq, 0, sizeof rq);
    rq.prompt = prompt;
    rq.num_prompt = 20;
    KVT_EQ(kvs_sched_add(e.s, &rq, &id), KVS_OK); /* its slot: Initialized */
    KVT_EQ(kvs_sched_release(e.s, id), KVS_ESTATE);
    for (i = 0; i < 5000 && !pumped; i++) { /* the console has read both events */
        pthread_mutex_lock(&bus->lock);
        pumped = con->reader->ring.count == 0;
        pthread_mutex_unlock(&bus->lock);
        of_sleep_us(1000);
    }
    of_sleep_us(100000); /* and noted them */
    fd = socket(AF_UNIX, SOCK_STREAM, 0);
    KVT_EQ(connect_console(fd, path), 0);
    KVT_CHECK(recv_within(fd, buf, sizeof buf, 2000));
    KVT_EQ(kvs_event_decode(buf + KVS_LOG_HEADER_BYTES, &got), KVS_OK);
    KVT_EQ(got.kind, KVS_EV_SLOT);
    KVT_EQ(got.request, id);
    close(fd);
    obs_close(&e);
    kvs_console_stop(con);
    kvs_bus_destroy(bus);
}

/* Every descriptor below a lowered limit taken: *probe the lowest free one, fill[] its dups (at most 64);
 * *saved the limit to give back with descriptors_back. Returns how many were filled. */
static int descriptors_exhaust(struct rlimit *saved, int *probe, int *fill)
{
    struct rlimit low;
    int filled = 0;
    KVT_EQ(getrlimit(RLIMIT_NOFILE, saved), 0);
    *probe = open("/dev/null", O_RDONLY);
    KVT_CHECK(*probe >= 0);
    low = *saved;
    low.rlim_cur = (rlim_t)*probe + 32;
    KVT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
    while (filled < 64 && (fill[filled] = dup(*probe)) >= 0) filled++;
    KVT_CHECK(filled < 64 && errno == EMFILE);
    return filled;
}

static void descriptors_back(const struct rlimit *saved, int probe, const int *fill, int filled)
{
    for (int i = 0; i < filled; i++) close(fill[i]);
    close(probe);
    KVT_EQ(setrlimit(RLIMIT_NOFILE, saved), 0);
}

static double process_cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* A client that attaches gets each live request's last SLOT event once, before the history: requests
 * finished and released in any order (the console's list moves its last entry into a released one's
 * place) are not among them, and a request whose slot changed twice comes with its last state. */
static void console_welcome_gives_the_live_slots(void)
{
    enum { REQS = 60 };
    kvs_bus *bus = new_bus();
    kvs_console *con = NULL;
    kvs_console_config cc;
    char path[64];
    unsigned char header[KVS_LOG_HEADER_BYTES];
    static kvs_event got[4 * REQS];
    uint32_t want[REQS + 1];
    size_t published = 0, n, live = 0, i;
    int a, b;
    snprintf(path, sizeof path, "/tmp/kvs_obs_welcome_%d.sock", (int)getpid());
    memset(&cc, 0, sizeof cc);
    cc.path = path;
    KVT_EQ(kvs_console_start(bus, &cc, &con), KVS_OK);
    if (!con) return;
    a = socket(AF_UNIX, SOCK_STREAM, 0);
    KVT_EQ(connect_console(a, path), 0);
    KVT_CHECK(recv_within(a, header, sizeof header, 5000)); /* attached: it sees what comes from now on */
    memset(want, 0, sizeof want);
    for (uint64_t r = 1; r <= REQS; r++, published++) {
        publish_slot(bus, r, 1);
        want[r] = 1;
    }
    publish_slot(bus, 7, 3), want[7] = 3, published++;
    for (uint64_t r = REQS; r >= 1; r--) /* the last, the first, and every third between */
        if (r == REQS || r == 1 || r % 3 == 0) {
            publish_slot(bus, r, KVS_SLOT_FINISHED);
            publish_release(bus, r);
            want[r] = 0, published += 2;
        }
    publish_release(bus, 2), published++; /* refused (not Finished): the slot lives on */
    publish_slot(bus, 5, 4), want[5] = 4, published++;
    KVT_EQ(recv_records(a, got, 4 * REQS, 2000), published); /* the console has seen them all */
    b = socket(AF_UNIX, SOCK_STREAM, 0);
    KVT_EQ(connect_console(b, path), 0);
    KVT_CHECK(recv_within(b, header, sizeof header, 5000));
    for (i = 1; i <= REQS; i++) live += want[i] != 0;
    n = recv_records(b, got, 4 * REQS, 300);
    KVT_EQ(n, live + published);
    for (i = 0; i < live && i < n; i++) {
        KVT_EQ(got[i].kind, KVS_EV_SLOT);
        KVT_CHECK(got[i].request >= 1 && got[i].request <= REQS);
        if (got[i].request < 1 || got[i].request > REQS) continue;
        KVT_EQ(got[i].u.slot.to, want[got[i].request]);
        want[got[i].request] = 0; /* once */
    }
    close(a);
    close(b);
    kvs_console_stop(con);
    kvs_bus_destroy(bus);
}

/* A console that cannot accept (the process is out of file descriptors, EMFILE) does not spin: the
 * client waiting to be accepted made its listening socket readable at every poll, and the thread tried
 * again at once, a core's worth of CPU. Now it waits between tries: a second of it costs little CPU, a
 * client already attached still gets every event, and once descriptors are free the waiting client is
 * served. */
static void console_out_of_descriptors_backs_off(void)
{
    kvs_bus *bus = new_bus();
    kvs_console *con = NULL;
    kvs_console_config cc;
    kvs_event ev = sample_event(KVS_EV_SLOT), got;
    struct rlimit saved;
    unsigned char head[KVS_LOG_HEADER_BYTES], rec[KVS_RECORD_BYTES];
    char path[64];
    int attached, waiting, probe, fill[64], filled;
    double cpu;
    snprintf(path, sizeof path, "/tmp/kvs_obs_emfile_%d.sock", (int)getpid());
    memset(&cc, 0, sizeof cc);
    cc.path = path;
    KVT_EQ(kvs_console_start(bus, &cc, &con), KVS_OK);
    if (!con) return;
    attached = socket(AF_UNIX, SOCK_STREAM, 0);
    waiting = socket(AF_UNIX, SOCK_STREAM, 0); /* made now: later there is no descriptor for it */
    KVT_EQ(connect_console(attached, path), 0);
    KVT_CHECK(recv_within(attached, head, sizeof head, 5000));

    /* every descriptor below a lowered limit taken, then a client knocks */
    filled = descriptors_exhaust(&saved, &probe, fill);
    KVT_EQ(connect_console(waiting, path), 0); /* queued: the console cannot accept it */

    cpu = process_cpu_s();
    of_sleep_us(1000000);
    cpu = process_cpu_s() - cpu;
    if (cpu >= 0.2) fprintf(stderr, "  %.3f s of CPU in a second without descriptors\n", cpu);
    KVT_CHECK(cpu < 0.2);
    KVT_EQ(kvs_bus_publish(bus, &ev), KVS_OK);
    KVT_CHECK(recv_within(attached, rec, sizeof rec, 5000));
    KVT_EQ(kvs_event_decode(rec, &got), KVS_OK);
    KVT_EQ(got.kind, KVS_EV_SLOT);
    KVT_EQ(got.request, ev.request);

    /* descriptors free again: the waiting client gets its welcome */
    descriptors_back(&saved, probe, fill, filled);
    KVT_CHECK(recv_within(waiting, head, sizeof head, 5000));
    close(attached);
    close(waiting);
    kvs_console_stop(con);
    kvs_bus_destroy(bus);
}

/* A publisher that never lets up (another thread floods the bus) while clients are attached. */
typedef struct console_flood {
    kvs_bus *bus;
    atomic_int stop;
} console_flood;

static void *console_flood_main(void *arg)
{
    console_flood *f = (console_flood *)arg;
    kvs_event ev = sample_event(KVS_EV_STEP);
    uint64_t give_up = of_now_us() + 20000000; /* a hang guard: the test never waits on it when it passes */
    while (!atomic_load(&f->stop) && of_now_us() < give_up) (void)kvs_bus_publish(f->bus, &ev);
    return NULL;
}

#define CONSOLE_FLOOD_CLIENTS 40

/* While another thread publishes faster than the console sends (40 clients that never read), the console
 * still takes commands and clients, and kvs_console_stop returns within its second of flushing. Before,
 * the console drained its reader batch after batch for as long as each batch came back full: it never
 * polled again, so a client's "pause" waited, a new client got no welcome, and kvs_console_stop (the
 * engine's thread) blocked until the publishing ended (here its 20 s guard). Now the console reads at
 * most a bounded share of its reader per turn; what the reader cannot keep is lost, as the manual says. */
static void console_serves_clients_while_the_bus_floods(void)
{
    kvs_bus *bus = new_bus();
    kvs_console *con = NULL;
    kvs_console_config cc;
    console_flood flood;
    pthread_t th;
    unsigned char head[KVS_LOG_HEADER_BYTES];
    char path[64];
    int idle[CONSOLE_FLOOD_CLIENTS], fresh, i, paused = 0;
    uint64_t t0;
    snprintf(path, sizeof path, "/tmp/kvs_obs_flood_%d.sock", (int)getpid());
    memset(&cc, 0, sizeof cc);
    cc.path = path;
    KVT_EQ(kvs_console_start(bus, &cc, &con), KVS_OK);
    if (!con) return;
    for (i = 0; i < CONSOLE_FLOOD_CLIENTS; i++) { /* attached (welcomed), then never read again */
        idle[i] = socket(AF_UNIX, SOCK_STREAM, 0);
        KVT_EQ(connect_console(idle[i], path), 0);
        KVT_CHECK(recv_within(idle[i], head, sizeof head, 5000));
    }
    memset(&flood, 0, sizeof flood);
    flood.bus = bus;
    KVT_EQ(pthread_create(&th, NULL, console_flood_main, &flood), 0);
    of_sleep_us(300000);

    fresh = socket(AF_UNIX, SOCK_STREAM, 0); /* a client attaches and pauses the engine, mid-flood */
    KVT_EQ(connect_console(fresh, path), 0);
    KVT_CHECK(recv_within(fresh, head, sizeof head, 8000));
    KVT_EQ(send(fresh, "pause\n", 6, MSG_NOSIGNAL), 6);
    for (t0 = of_now_us(); !paused && of_now_us() - t0 < 8000000;) {
        pthread_mutex_lock(&bus->lock);
        paused = bus->pause_pending;
        pthread_mutex_unlock(&bus->lock);
        if (!paused) of_sleep_us(1000);
    }
    KVT_CHECK(paused);
    KVT_EQ(kvs_bus_resume(bus), KVS_OK);

    t0 = of_now_us(); /* stopped mid-flood: at most its second of flushing, and a turn */
    kvs_console_stop(con);
    t0 = of_now_us() - t0;
    if (t0 >= 8000000) fprintf(stderr, "  kvs_console_stop took %.1f s while the bus was flooded\n", (double)t0 / 1e6);
    KVT_CHECK(t0 < 8000000); /* a loaded machine has room; the flood lasts 20 s */
    atomic_store(&flood.stop, 1);
    pthread_join(th, NULL);
    for (i = 0; i < CONSOLE_FLOOD_CLIENTS; i++) close(idle[i]);
    close(fresh);
    kvs_bus_destroy(bus);
}

/* A reader's lost count is of the events dropped since the last read, whether that read asked for the
 * count or not. Before, a read without out_lost left the old drops to be reported by the next one. */
static void reader_lost_counts_since_the_last_read(void)
{
    kvs_bus *bus = new_bus();
    kvs_reader *r = NULL;
    kvs_event ev = sample_event(KVS_EV_SLOT), out[4];
    size_t n = 0;
    uint64_t lost = 99;
    KVT_EQ(kvs_reader_open(bus, 0, 2, &r), KVS_OK);
    if (!r) return;
    for (int i = 0; i < 5; i++) KVT_EQ(kvs_bus_publish(bus, &ev), KVS_OK); /* 3 dropped */
    KVT_EQ(kvs_reader_read(r, out, 4, &n, NULL), KVS_OK);
    KVT_EQ(n, 2);
    KVT_EQ(kvs_bus_publish(bus, &ev), KVS_OK);
    KVT_EQ(kvs_reader_read(r, out, 4, &n, &lost), KVS_OK);
    KVT_EQ(n, 1);
    KVT_EQ(lost, 0);
    for (int i = 0; i < 3; i++) KVT_EQ(kvs_bus_publish(bus, &ev), KVS_OK); /* 1 dropped */
    KVT_EQ(kvs_reader_read(r, out, 4, &n, &lost), KVS_OK);
    KVT_EQ(n, 2);
    KVT_EQ(lost, 1);
    kvs_reader_close(r);
    kvs_bus_destroy(bus);
}

/* kvs_bus_wait_paused with a negative timeout waits without a limit, and a deadline in the past is a
 * valid one. Before, a negative timeout made a deadline with a negative tv_nsec, which
 * pthread_cond_timedwait refuses (EINVAL, not ETIMEDOUT): the wait spun on a core for ever. */
static void wait_paused_negative_timeout(void)
{
    kvs_bus *bus = new_bus();
    struct timespec dl = kvo__deadline(-982088);
    kvs_pause_info info;
    KVT_CHECK(dl.tv_nsec >= 0 && dl.tv_nsec < 1000000000L);
    dl = kvo__deadline(-3000000);
    KVT_CHECK(dl.tv_nsec >= 0 && dl.tv_nsec < 1000000000L);
    KVT_EQ(kvs_bus_wait_paused(bus, 0, &info), KVS_ETIMEDOUT);
    pthread_mutex_lock(&bus->lock); /* a thread stopped (as a hook stops one), then the wait */
    bus->stopped = 1;
    pthread_mutex_unlock(&bus->lock);
    KVT_EQ(kvs_bus_wait_paused(bus, -5, &info), KVS_OK);
    pthread_mutex_lock(&bus->lock);
    bus->stopped = 0;
    pthread_mutex_unlock(&bus->lock);
    kvs_bus_destroy(bus);
}

/* Console B replaces console A's socket (the documented takeover); stopping A then leaves B's socket,
 * and clients still reach B. Before, A's stop removed whatever was at the path. */
static void console_stop_leaves_a_newer_consoles_socket(void)
{
    kvs_bus *bus = new_bus();
    kvs_console *a = NULL, *b = NULL;
    kvs_console_config cc;
    unsigned char head[KVS_LOG_HEADER_BYTES];
    struct stat st;
    char path[64];
    int fd;
    snprintf(path, sizeof path, "/tmp/kvs_obs_takeover_%d.sock", (int)getpid());
    memset(&cc, 0, sizeof cc);
    cc.path = path;
    KVT_EQ(kvs_console_start(bus, &cc, &a), KVS_OK);
    KVT_EQ(kvs_console_start(bus, &cc, &b), KVS_OK);
    if (!a || !b) return;
    kvs_console_stop(a);
    KVT_EQ(lstat(path, &st), 0);
    fd = socket(AF_UNIX, SOCK_STREAM, 0);
    KVT_EQ(connect_console(fd, path), 0);
    KVT_CHECK(recv_within(fd, head, sizeof head, 5000));
    close(fd);
    kvs_console_stop(b);
    KVT_CHECK(lstat(path, &st) != 0); /* its own socket goes with it */
    kvs_bus_destroy(bus);
}

/* A start that fails (here out of file descriptors, with none, one or two left: its pipe or its socket
 * fails) leaves the socket of the console serving the path: it keeps taking clients. Before, the old
 * socket was removed first, whatever happened next. */
static void console_failed_start_leaves_the_old_socket(void)
{
    kvs_bus *bus = new_bus();
    kvs_console *a = NULL, *b = (kvs_console *)1;
    kvs_console_config cc;
    unsigned char head[KVS_LOG_HEADER_BYTES];
    struct rlimit saved;
    struct stat st;
    char path[64];
    int client, probe, fill[64], filled, i;
    snprintf(path, sizeof path, "/tmp/kvs_obs_failstart_%d.sock", (int)getpid());
    memset(&cc, 0, sizeof cc);
    cc.path = path;
    KVT_EQ(kvs_console_start(bus, &cc, &a), KVS_OK);
    if (!a) return;
    client = socket(AF_UNIX, SOCK_STREAM, 0); /* made now: later there is no descriptor for it */
    filled = descriptors_exhaust(&saved, &probe, fill);
    for (int spare = 0; spare <= 2 && filled >= 2; spare++) {
        struct stat now;
        for (i = 0; i < spare; i++) close(fill[filled - 1 - i]);
        KVT_EQ(kvs_console_start(bus, &cc, &b), KVS_EIO);
        KVT_EQ(lstat(path, &now), 0);
        for (i = 0; i < spare; i++) KVT_CHECK((fill[filled - 1 - i] = dup(probe)) >= 0);
    }
    descriptors_back(&saved, probe, fill, filled);
    KVT_CHECK(b == (kvs_console *)1);
    KVT_EQ(lstat(path, &st), 0);
    KVT_CHECK(S_ISSOCK(st.st_mode));
    KVT_EQ(connect_console(client, path), 0);
    KVT_CHECK(recv_within(client, head, sizeof head, 5000));
    close(client);
    kvs_console_stop(a);
    kvs_bus_destroy(bus);
}

static void null_arguments_are_invalid(void)
{
    kvs_bus *bus = new_bus();
    kvs_event ev = sample_event(KVS_EV_SLOT), out;
    unsigned char rec[KVS_RECORD_BYTES];
    char json[512];
    size_t n = 0, len = 0;
    uint32_t id = 0;
    uint64_t lost = 0;
    kvs_reader *r = NULL;
    kvs_recorder *rc = NULL;
    kvs_recorder_config rcfg;
    kvs_breakpoint bp;
    kvs_pause_info info;
    kvs_log_report lrep;
    kvs_replay_report rrep;
    kvs_event *events = NULL;
    kvs_console *con = NULL;
    kvs_console_config cc;
    obs_env e;
    memset(&rcfg, 0, sizeof rcfg);
    memset(&bp, 0, sizeof bp);
    bp.state = KVS_SLOT_DECODING;
    memset(&cc, 0, sizeof cc);
    obs_open(&e, 8, 0, bus);

    KVT_EQ(kvs_event_encode(NULL, rec), KVS_EINVAL);
    KVT_EQ(kvs_event_encode(&ev, NULL), KVS_EINVAL);
    KVT_EQ(kvs_event_decode(NULL, &out), KVS_EINVAL);
    KVT_EQ(kvs_event_encode(&ev, rec), KVS_OK);
    KVT_EQ(kvs_event_decode(rec, NULL), KVS_EINVAL);
    KVT_EQ(kvs_event_to_json(NULL, json, sizeof json, &len), KVS_EINVAL);
    KVT_EQ(kvs_event_to_json(&ev, json, sizeof json, NULL), KVS_EINVAL);
    KVT_EQ(kvs_event_from_json(NULL, &out), KVS_EINVAL);
    KVT_EQ(kvs_event_to_json(&ev, json, sizeof json, &len), KVS_OK);
    KVT_EQ(kvs_event_from_json(json, NULL), KVS_EINVAL);

    KVT_EQ(kvs_bus_create(NULL, NULL), KVS_EINVAL);
    kvs_bus_destroy(NULL);
    KVT_EQ(kvs_bus_publish(NULL, &ev), KVS_EINVAL);
    KVT_EQ(kvs_bus_publish(bus, NULL), KVS_EINVAL);
    KVT_EQ(kvs_bus_subscribe(NULL, 0, flood_count, NULL, &id), KVS_EINVAL);
    KVT_EQ(kvs_bus_subscribe(bus, 0, NULL, NULL, &id), KVS_EINVAL);
    KVT_EQ(kvs_bus_unsubscribe(NULL, 1), KVS_EINVAL);
    KVT_EQ(kvs_reader_open(NULL, 0, 8, &r), KVS_EINVAL);
    KVT_EQ(kvs_reader_open(bus, 0, 8, NULL), KVS_EINVAL);
    kvs_reader_close(NULL);
    KVT_EQ(kvs_reader_read(NULL, &out, 1, &n, &lost), KVS_EINVAL);
    KVT_EQ(kvs_reader_open(bus, 0, 8, &r), KVS_OK);
    KVT_EQ(kvs_reader_read(r, NULL, 1, &n, &lost), KVS_EINVAL);
    KVT_EQ(kvs_reader_read(r, &out, 1, NULL, &lost), KVS_EINVAL);
    kvs_reader_close(r);
    kvs_bus_pool_events(NULL, 0, NULL); /* void adapters: no crash */
    kvs_bus_pool_events(NULL, 0, bus);
    kvs_bus_transfer_stage(NULL, NULL);
    kvs_bus_transfer_stage(bus, NULL);

    KVT_EQ(kvs_bus_set_hook(NULL, hook_note, NULL), KVS_EINVAL);
    KVT_EQ(kvs_bus_break_add(NULL, &bp, &id), KVS_EINVAL);
    KVT_EQ(kvs_bus_break_add(bus, NULL, &id), KVS_EINVAL);
    KVT_EQ(kvs_bus_break_remove(NULL, 0), KVS_EINVAL);
    KVT_EQ(kvs_bus_pause(NULL), KVS_EINVAL);
    KVT_EQ(kvs_bus_resume(NULL), KVS_EINVAL);
    KVT_EQ(kvs_bus_wait_paused(NULL, 1000, &info), KVS_EINVAL);
    KVT_EQ(kvs_bus_paused(NULL, &info), 0);

    KVT_EQ(kvs_recorder_create(NULL, &rcfg, &rc), KVS_EINVAL);
    KVT_EQ(kvs_recorder_create(bus, &rcfg, NULL), KVS_EINVAL);
    kvs_recorder_destroy(NULL);
    KVT_EQ(kvs_recorder_snapshot(NULL, NULL, 0, &n, NULL), KVS_EINVAL);
    KVT_EQ(kvs_recorder_flush(NULL), KVS_EINVAL);
    KVT_EQ(kvs_recorder_create(bus, &rcfg, &rc), KVS_OK);
    KVT_EQ(kvs_recorder_snapshot(rc, NULL, 0, NULL, NULL), KVS_EINVAL);
    kvs_recorder_destroy(rc);
    KVT_EQ(kvs_log_read(NULL, &events, &n, &lrep), KVS_EINVAL);
    KVT_EQ(kvs_log_read("/tmp/x", NULL, &n, &lrep), KVS_EINVAL);
    KVT_EQ(kvs_log_read("/tmp/x", &events, NULL, &lrep), KVS_EINVAL);
    kvs_log_free(NULL);

    KVT_EQ(kvs_replay(NULL, bus, &ev, 1, 0, &rrep), KVS_EINVAL);
    KVT_EQ(kvs_replay(e.s, NULL, &ev, 1, 0, &rrep), KVS_EINVAL);
    KVT_EQ(kvs_replay(e.s, bus, NULL, 1, 0, &rrep), KVS_EINVAL);

    KVT_EQ(kvs_console_start(NULL, &cc, &con), KVS_EINVAL);
    KVT_EQ(kvs_console_start(bus, NULL, &con), KVS_EINVAL);
    KVT_EQ(kvs_console_start(bus, &cc, &con), KVS_EINVAL); /* no path */
    cc.path = "/tmp/kvobs-never.sock";
    KVT_EQ(kvs_console_start(bus, &cc, NULL), KVS_EINVAL);
    kvs_console_stop(NULL);

    KVT_EQ(kvs_metrics_write(NULL, NULL, json, sizeof json, &len), KVS_EINVAL);
    KVT_EQ(kvs_metrics_write(e.s, NULL, json, sizeof json, NULL), KVS_EINVAL);
    KVT_EQ(kvs_metrics_write(e.s, NULL, NULL, 100, &len), KVS_EINVAL); /* a capacity but no buffer */

    KVT_CHECK(kvs_event_kind_name((kvs_event_kind)0) != NULL);
    KVT_CHECK(kvs_event_kind_name((kvs_event_kind)999) != NULL);
    KVT_CHECK(kvs_transfer_stage_name((kvs_transfer_stage)999) != NULL);
    KVT_CHECK(kvs_call_name((kvs_call)999) != NULL);
    KVT_CHECK(strcmp(kvs_result_string(KVS_EREPLAY), "replay differs from the recording") == 0);
    obs_close(&e);
    kvs_bus_destroy(bus);
}

int main(void)
{
    of_watchdog(600);
    /* 1 */
    KVT_RUN(every_event_kind_survives_the_binary_form);
    KVT_RUN(binary_record_is_the_struct_bytes_and_their_crc32c);
    KVT_RUN(both_crc_paths_agree);
    KVT_RUN(decode_rejects_damaged_records);
    KVT_RUN(every_event_kind_survives_the_json_form);
    KVT_RUN(json_names_kinds_states_and_stages);
    KVT_RUN(json_into_a_short_buffer_says_how_much_is_needed);
    KVT_RUN(json_parser_rejects_what_the_writer_never_writes);
    /* 2 */
    KVT_RUN(slow_reader_never_blocks_publishing_and_keeps_the_newest);
    KVT_RUN(reader_reads_in_pieces_and_unsubscribed_callbacks_stop);
    KVT_RUN(bus_clock_stamps_time);
    KVT_RUN(pool_events_reach_the_bus_as_block_events);
    KVT_RUN(transfer_stages_reach_the_bus);
    /* 3 */
    KVT_RUN(log_file_reads_back_what_was_recorded);
    KVT_RUN(cut_short_log_keeps_the_whole_records);
    KVT_RUN(corrupt_record_stops_the_log_where_it_is);
    KVT_RUN(missing_or_foreign_file_is_an_io_error);
    KVT_RUN(read_error_in_the_middle_of_a_log_is_an_io_error);
    KVT_RUN(recorder_keeps_only_its_kinds_and_counts_what_no_longer_fits);
    KVT_RUN(recorder_on_a_full_device_fails_at_create);
    /* 4 */
    KVT_RUN(recorded_run_preempts_and_hits_the_device_cache);
    KVT_RUN(replay_of_a_recorded_run_matches);
    KVT_RUN(replay_from_the_log_file_matches);
    KVT_RUN(replay_maps_request_ids_in_order_of_addition);
    KVT_RUN(replay_into_another_config_reports_the_first_difference);
    KVT_RUN(replay_of_a_tampered_recording_differs);
    KVT_RUN(replay_of_a_recording_cut_short_differs);
    KVT_RUN(replay_carries_extra_keys);
    KVT_RUN(replay_compares_no_input_kinds);
    /* 5 */
    KVT_RUN(state_breakpoint_holds_the_engine_until_resumed);
    KVT_RUN(request_breakpoint_stops_only_that_request);
    KVT_RUN(call_breakpoint_stops_at_the_call);
    KVT_RUN(call_and_state_breakpoint_stops_at_a_transition_in_that_call);
    KVT_RUN(pause_stops_a_running_engine_at_its_next_call);
    KVT_RUN(pause_before_the_first_call_stops_at_it);
    KVT_RUN(wait_paused_with_nothing_running_times_out);
    KVT_RUN(resume_cancels_a_pause_not_reached);
    KVT_RUN(resumed_thread_no_longer_counts_as_stopped);
    KVT_RUN(breakpoint_all_zero_is_invalid);
    KVT_RUN(hooks_see_every_call_before_and_after);
    KVT_RUN(hooks_see_connector_calls_with_tiers);
    KVT_RUN(removing_a_hook_waits_out_the_call_in_progress);
    KVT_RUN(replacing_a_hook_waits_for_the_old_one_only);
    /* 6 */
    KVT_RUN(metrics_validator_knows_good_from_bad);
    KVT_RUN(metrics_are_valid_prometheus_text);
    KVT_RUN(metrics_count_what_the_stats_count);
    KVT_RUN(metrics_with_tiers_and_disk_are_valid_prometheus_text);
    KVT_RUN(metrics_label_pools_by_their_place_in_the_chain);
    KVT_RUN(metrics_into_a_short_buffer_say_how_much_is_needed);
    KVT_RUN(metrics_count_the_bus_events);
    KVT_RUN(metrics_text_is_whole_when_a_counter_gains_a_digit);
    KVT_RUN(metrics_text_is_whole_while_another_thread_counts);
    /* 7 */
    KVT_RUN(console_drops_an_overlong_line_whole);
    KVT_RUN(console_welcome_gives_the_live_slots);
    KVT_RUN(console_out_of_descriptors_backs_off);
    KVT_RUN(console_serves_clients_while_the_bus_floods);
    KVT_RUN(console_stop_leaves_a_newer_consoles_socket);
    KVT_RUN(console_failed_start_leaves_the_old_socket);
    KVT_RUN(reader_lost_counts_since_the_last_read);
    KVT_RUN(wait_paused_negative_timeout);
    KVT_RUN(null_arguments_are_invalid);
    KVT_RUN(refused_add_publishes_nothing);
    KVT_RUN(empty_append_with_null_tokens_is_recorded);
    KVT_RUN(console_keeps_the_slot_of_a_refused_release);
    return kvt_summary();
}
