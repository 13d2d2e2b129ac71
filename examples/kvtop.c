/* kvtop.c — a terminal console for a kvcache engine: request slots, tier occupancy, transfers in flight,
 * the prefix-cache hit rate and one request's timeline, live from an engine's kvs_console socket or
 * offline from a recorder's log file; pause, resume and breakpoints from the keyboard. Plain ANSI
 * escape codes, no curses.
 *
 *   make build/kvtop build/serve_sim
 *   ./build/serve_sim --pace-us 20000 --console /tmp/kv.sock &    # an engine to watch
 *   ./build/kvtop /tmp/kv.sock                                   # attach live
 *   ./build/serve_sim --requests 50 --record /tmp/kv.log && ./build/kvtop --log /tmp/kv.log
 *   ./build/kvtop --log /tmp/kv.log --once                       # one plain-text frame, then exit
 *   ./build/kvtop --help
 *
 * Build by hand:
 *   cc -std=c11 -O2 -D_GNU_SOURCE -I. -I/usr/include/stb examples/kvtop.c -o kvtop -pthread -lm
 *
 * OPTIONS
 *   SOCKET          attach to an engine's kvs_console (kvsched.h, section 8)
 *   --log FILE      read a kvs_recorder log instead; damage is reported on the status line and the
 *                   records before it are shown
 *   --once          read what is there (live: for about 0.5 s; a log: all of it), print one frame as
 *                   plain text (no cursor codes), exit
 *   --request ID    show this request's timeline (default: the most recently active one, followed
 *                   until it finishes)
 *
 * KEYS (live)
 *   p pause the engine thread at its next call      r resume it
 *   b break when a slot enters a state (Decoding, ...) or at a call (sched_step, ...): asks for the name
 *   R break on a request: asks for its id          c clear all breakpoints
 *   j / k (or the arrows) select the next / previous slot; a follows the most recently active again
 *   q quit (also Ctrl-C)
 *
 * PROTOCOL (the server is kvs_console in kvsched.h): the server sends the 16-byte header of a log file
 * ("KVSEVLOG", uint32 version, uint32 record size, little-endian), then records of KVS_RECORD_BYTES
 * (kvs_event_decode): a snapshot (the last SLOT event of every live request, the latest STEP and TIERS),
 * the history, then live events; an event may come twice. The client sends lines: pause, resume,
 * break state NAME, break request ID, break call NAME, clear. PAUSED / RESUMED events say when the
 * engine thread stopped and went on.
 *
 * THE MODEL is built the same way from the socket and from a log, and is idempotent: a SLOT event sets
 * its request's state only when it is newer (by seq) than the one the state came from; STEP and TIERS
 * keep the newest; every other kind is applied once, in seq order per kind. The hit rate is
 * sum(device_hit_tokens + lower_hit_tokens) / sum(prompt_tokens) over the ADMIT events seen (attached
 * late, that is the history's). A slot's tokens are its last SLOT event's plus the APPENDs since;
 * computed is as of its last transition. The history and the live events come in seq order: a jump is
 * events the engine's console lost (its reader fell behind), counted on the status line.
 *
 * EXIT STATUS: 0 ok (a damaged log too: it is shown); 1 the socket or the log cannot be read; 2 usage.
 */
#define KVCACHE_IMPLEMENTATION
#include "kvsched.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#define TIMELINE_LEN 12        /* events kept per request */
#define MAX_ROWS 4096          /* beyond this, the oldest finished requests are forgotten */
#define MAX_XFERS 4096         /* transfers in flight kept */
#define REDRAW_NS 100000000ull /* at most one frame per 100 ms */
#define ONCE_LIVE_NS 500000000ull
#define IN_STREAM 64           /* events in seq order after which a gap counts as lost events */
#define FRAME_LINES 256
#define LINE_BYTES 512

/* ---- small utilities ---------------------------------------------------------------------------- */

static void *xrealloc(void *p, size_t n)
{
    void *q = realloc(p, n ? n : 1);
    if (!q) {
        fprintf(stderr, "kvtop: out of memory\n");
        exit(1);
    }
    return q;
}

/* Grow array p (capacity *cap elements of `size`) so that index need - 1 is valid. */
static void *grow_to(void *p, size_t *cap, size_t need, size_t size)
{
    size_t c = *cap ? *cap : 16;
    if (need <= *cap) return p;
    while (c < need) c *= 2;
    *cap = c;
    return xrealloc(p, c * size);
}
#define GROW(p, cap, need) ((p) = grow_to((p), &(cap), (need), sizeof *(p)))

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint32_t le32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static double percent(uint64_t a, uint64_t b) { return b ? 100.0 * (double)a / (double)b : 0.0; }

/* ---- the model: what the events say ------------------------------------------------------------- */

typedef struct moment {        /* one line of a timeline: an event, or a run of APPENDs merged */
    kvs_event e;               /* the first of the run */
    uint64_t last_seq;         /* the last of the run (e.seq when alone) */
    uint32_t count;            /* events in the run */
    uint64_t tokens;           /* APPEND runs: the tokens appended */
} moment;

typedef struct row {           /* one request */
    uint64_t request;
    uint32_t state;            /* kvs_slot_state; 0 until a SLOT event */
    uint64_t tokens, computed; /* from the SLOT event the state comes from (computed: as of that transition) */
    uint64_t appended;         /* tokens appended since that event */
    uint64_t prompt, hit;      /* prompt tokens (ADD, then ADMIT), device + lower hit tokens (the latest ADMIT) */
    int added, admitted;       /* an ADD / ADMIT was seen (attached late, it may not have been) */
    uint64_t slot_seq;         /* the SLOT event the state comes from */
    uint64_t active_seq;       /* the newest event about it */
    moment timeline[TIMELINE_LEN]; /* the newest events about it, oldest first */
    uint32_t timeline_n;
} row;

typedef struct transfer {      /* one transfer, keyed by (src, dst, id) */
    uint64_t id, seq;
    uint32_t src, dst, blocks, stage, onboard;
} transfer;

/* request id -> index in rows: open addressing, rebuilt whenever rows are dropped */
typedef struct row_index { uint64_t *key; uint32_t *val; size_t mask, n; } row_index;

typedef struct model {
    row *rows;
    size_t nrows, caprows;
    row_index index;
    transfer *xfers;           /* in flight only */
    size_t nxfers, capxfers;
    uint64_t applied[KVS_EV__COUNT]; /* per kind: the newest seq applied (kinds applied once) */
    kvs_event step, tiers;     /* the newest of each (kind 0: none yet) */
    uint64_t paused_seq, resumed_seq;
    kvs_event paused;          /* the newest PAUSED */
    uint64_t admits, prompt_tokens, device_hit_tokens, lower_hit_tokens;
    uint64_t t0;               /* the earliest time_ns seen (0 before any event): timelines are relative to it */
    uint64_t events, bad_records;
    uint64_t prev_seq, newest_seq, missing; /* missing: seqs the stream skipped (events the source lost) */
    uint32_t in_order;         /* events in a row that came in seq order (up to IN_STREAM) */
} model;

static uint64_t mix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static size_t index_slot(const row_index *ix, uint64_t key)
{
    size_t i = (size_t)mix64(key) & ix->mask;
    while (ix->val[i] != UINT32_MAX && ix->key[i] != key) i = (i + 1) & ix->mask;
    return i;
}

static void index_rebuild(row_index *ix, const row *rows, size_t n)
{
    size_t cap = 64, i;
    while (cap < n * 2 + 2) cap *= 2;
    free(ix->key);
    free(ix->val);
    ix->key = (uint64_t *)xrealloc(NULL, cap * sizeof *ix->key);
    ix->val = (uint32_t *)xrealloc(NULL, cap * sizeof *ix->val);
    for (i = 0; i < cap; i++) ix->val[i] = UINT32_MAX;
    ix->mask = cap - 1;
    ix->n = n;
    for (i = 0; i < n; i++) {
        size_t s = index_slot(ix, rows[i].request);
        ix->key[s] = rows[i].request;
        ix->val[s] = (uint32_t)i;
    }
}

static row *find_row(const model *m, uint64_t request)
{
    size_t s;
    if (!m->index.val) return NULL;
    s = index_slot(&m->index, request);
    return m->index.val[s] == UINT32_MAX ? NULL : &m->rows[m->index.val[s]];
}

static unsigned is_live(const row *r) { return r->state != KVS_SLOT_FINISHED; }

/* Table order: live before finished, then the most recently active first. */
static int row_order(const void *a, const void *b)
{
    const row *x = (const row *)a, *y = (const row *)b;
    if (is_live(x) != is_live(y)) return is_live(x) ? -1 : 1;
    return (x->active_seq < y->active_seq) - (x->active_seq > y->active_seq);
}

/* Keeps memory bounded on a long run: the oldest finished requests go first, live ones never. */
static void forget_finished(model *m)
{
    size_t keep = MAX_ROWS * 3 / 4, live = 0, i;
    qsort(m->rows, m->nrows, sizeof *m->rows, row_order);
    for (i = 0; i < m->nrows; i++) live += is_live(&m->rows[i]);
    m->nrows = live > keep ? live : keep;
    index_rebuild(&m->index, m->rows, m->nrows);
}

static row *get_row(model *m, uint64_t request)
{
    row *r = find_row(m, request);
    size_t s;
    if (r) return r;
    if (m->nrows >= MAX_ROWS) forget_finished(m);
    GROW(m->rows, m->caprows, m->nrows + 1);
    r = &m->rows[m->nrows];
    memset(r, 0, sizeof *r);
    r->request = request;
    if ((m->index.n + 1) * 2 > m->index.mask + 1 || !m->index.val) {
        m->nrows++;
        index_rebuild(&m->index, m->rows, m->nrows);
        return r;
    }
    s = index_slot(&m->index, request);
    m->index.key[s] = request;
    m->index.val[s] = (uint32_t)m->nrows++;
    m->index.n++;
    return r;
}

/* The request's newest TIMELINE_LEN moments, by seq, each event once; consecutive APPENDs (one per
 * decoded token) make one moment. */
static void timeline_add(row *r, const kvs_event *e)
{
    uint32_t i, at;
    moment *last = r->timeline_n ? &r->timeline[r->timeline_n - 1] : NULL;
    for (i = 0; i < r->timeline_n; i++)
        if (r->timeline[i].e.seq == e->seq || r->timeline[i].last_seq == e->seq) return;
    if (e->seq > r->active_seq) r->active_seq = e->seq;
    if (e->kind == KVS_EV_APPEND && last && last->e.kind == KVS_EV_APPEND && e->seq > last->last_seq) {
        last->last_seq = e->seq;
        last->count++;
        last->tokens += e->u.append.n;
        return;
    }
    if (r->timeline_n == TIMELINE_LEN) {
        if (e->seq < r->timeline[0].e.seq) return;
        memmove(r->timeline, r->timeline + 1, (TIMELINE_LEN - 1) * sizeof *r->timeline);
        r->timeline_n--;
    }
    for (at = r->timeline_n; at > 0 && r->timeline[at - 1].e.seq > e->seq; at--) r->timeline[at] = r->timeline[at - 1];
    r->timeline[at].e = *e;
    r->timeline[at].last_seq = e->seq;
    r->timeline[at].count = 1;
    r->timeline[at].tokens = e->kind == KVS_EV_APPEND ? e->u.append.n : 0;
    r->timeline_n++;
}

static void transfer_apply(model *m, const kvs_event *e)
{
    size_t i;
    int in_flight = e->u.transfer.stage == KVS_XFER_PENDING || e->u.transfer.stage == KVS_XFER_PROMOTED;
    transfer *x = NULL;
    for (i = 0; i < m->nxfers; i++)
        if (m->xfers[i].id == e->u.transfer.transfer && m->xfers[i].src == e->u.transfer.src_tier &&
            m->xfers[i].dst == e->u.transfer.dst_tier) {
            x = &m->xfers[i];
            break;
        }
    if (x && e->seq < x->seq) return;
    if (!in_flight) {
        if (x) *x = m->xfers[--m->nxfers];
        return;
    }
    if (!x && m->nxfers == MAX_XFERS) { /* final stages were lost: the oldest goes */
        size_t oldest = 0;
        for (i = 1; i < m->nxfers; i++)
            if (m->xfers[i].seq < m->xfers[oldest].seq) oldest = i;
        m->xfers[oldest] = m->xfers[--m->nxfers];
    }
    if (!x) {
        GROW(m->xfers, m->capxfers, m->nxfers + 1);
        x = &m->xfers[m->nxfers++];
    }
    x->id = e->u.transfer.transfer;
    x->seq = e->seq;
    x->src = e->u.transfer.src_tier;
    x->dst = e->u.transfer.dst_tier;
    x->blocks = e->u.transfer.blocks;
    x->stage = e->u.transfer.stage;
    x->onboard = e->u.transfer.onboard;
}

/* Kinds that describe the latest state (SLOT per request, STEP, TIERS) keep the newest by seq; the
 * others are applied once each, in seq order per kind (the snapshot and the history may overlap). */
static void model_apply(model *m, const kvs_event *e)
{
    row *r = NULL;
    if (!e->kind || e->kind >= KVS_EV__COUNT) {
        m->bad_records++;
        return;
    }
    if (!m->events++ || e->time_ns < m->t0) m->t0 = e->time_ns;
    /* Lost events: the snapshot comes in no order, but the history and the live events after it (and a
     * log) are every event in seq order; once IN_STREAM came in a row, a jump forward is a loss. */
    if (e->seq == m->prev_seq + 1) {
        if (m->in_order < IN_STREAM) m->in_order++;
    } else if (m->in_order < IN_STREAM) {
        m->in_order = 0;
    }
    if (m->in_order >= IN_STREAM && e->seq > m->newest_seq + 1) m->missing += e->seq - m->newest_seq - 1;
    if (e->seq > m->newest_seq) m->newest_seq = e->seq;
    m->prev_seq = e->seq;
    if (e->kind == KVS_EV_STEP || e->kind == KVS_EV_TIERS) {
        kvs_event *keep = e->kind == KVS_EV_STEP ? &m->step : &m->tiers;
        if (e->seq >= keep->seq) *keep = *e;
        return;
    }
    if (e->kind != KVS_EV_SLOT) {
        if (e->seq <= m->applied[e->kind]) return;
        m->applied[e->kind] = e->seq;
    }
    if (e->request && e->kind != KVS_EV_TOKENS) {
        r = get_row(m, e->request);
        timeline_add(r, e);
    }
    switch (e->kind) {
    case KVS_EV_SLOT:
        if (r && e->seq >= r->slot_seq) {
            r->slot_seq = e->seq;
            r->state = e->u.slot.to;
            r->tokens = e->u.slot.tokens;
            r->computed = e->u.slot.computed;
            r->appended = 0;
        }
        break;
    case KVS_EV_APPEND:
        if (r && e->seq > r->slot_seq) r->appended += e->u.append.n;
        break;
    case KVS_EV_ADD:
        if (r && !r->admitted) r->prompt = e->u.add.num_prompt;
        if (r) r->added = 1;
        break;
    case KVS_EV_ADMIT:
        m->admits++;
        m->prompt_tokens += e->u.admit.prompt_tokens;
        m->device_hit_tokens += e->u.admit.device_hit_tokens;
        m->lower_hit_tokens += e->u.admit.lower_hit_tokens;
        if (r) {
            r->admitted = 1;
            r->prompt = e->u.admit.prompt_tokens;
            r->hit = e->u.admit.device_hit_tokens + e->u.admit.lower_hit_tokens;
        }
        break;
    case KVS_EV_TRANSFER: transfer_apply(m, e); break;
    case KVS_EV_PAUSED:
        m->paused_seq = e->seq;
        m->paused = *e;
        break;
    case KVS_EV_RESUMED: m->resumed_seq = e->seq; break;
    default: break;
    }
}

static int model_paused(const model *m) { return m->paused_seq > m->resumed_seq; }

static void model_free(model *m)
{
    free(m->rows);
    free(m->xfers);
    free(m->index.key);
    free(m->index.val);
    memset(m, 0, sizeof *m);
}

/* ---- the console socket: header, then records ---------------------------------------------------- */

typedef struct stream {
    unsigned char buf[KVS_LOG_HEADER_BYTES + 4096 * KVS_RECORD_BYTES];
    size_t len;
    int header_ok;
} stream;

/* Applies every whole record in s; returns 0, or -1 when the header is not a kvcache event stream. */
static int stream_feed(stream *s, model *m)
{
    size_t at = 0;
    if (!s->header_ok) {
        if (s->len < KVS_LOG_HEADER_BYTES) return 0;
        if (memcmp(s->buf, "KVSEVLOG", 8) || le32(s->buf + 8) != KVS_EVENT_VERSION ||
            le32(s->buf + 12) != KVS_RECORD_BYTES)
            return -1;
        s->header_ok = 1;
        at = KVS_LOG_HEADER_BYTES;
    }
    for (; s->len - at >= KVS_RECORD_BYTES; at += KVS_RECORD_BYTES) {
        kvs_event e;
        if (kvs_event_decode(s->buf + at, &e) == KVS_OK) model_apply(m, &e);
        else m->bad_records++;
    }
    memmove(s->buf, s->buf + at, s->len - at);
    s->len -= at;
    return 0;
}

static int console_connect(const char *path, char *why, size_t whylen)
{
    struct sockaddr_un addr;
    int fd;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    if (strlen(path) >= sizeof addr.sun_path) {
        snprintf(why, whylen, "socket path too long");
        return -1;
    }
    memcpy(addr.sun_path, path, strlen(path) + 1);
    if ((fd = socket(AF_UNIX, SOCK_STREAM, 0)) < 0 || connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) {
        snprintf(why, whylen, "%s", strerror(errno));
        if (fd >= 0) close(fd);
        return -1;
    }
    return fd;
}

/* ---- the application ---------------------------------------------------------------------------- */

typedef struct app {
    model m;
    const char *source;
    int log_mode, once, styled;
    int sock;                  /* -1: none (a log, or the engine went away) */
    int not_a_console;         /* the socket sent something other than a kvcache event stream */
    stream in;
    uint64_t pinned;           /* --request, or chosen with j/k; 0: follow */
    uint64_t followed;         /* the request followed when not pinned */
    char note[256];            /* what stays said: the log's damage, the engine gone */
    char status[256];          /* the last message */
    char prompt_kind;          /* 'b' or 'R' while a name or id is typed on the bottom line; 0 otherwise */
    char prompt[64];
    size_t prompt_len;
    int width, height;
    uint64_t shown[FRAME_LINES]; /* the requests of the slot table as last drawn (j/k move through them) */
    size_t nshown;
} app;

static void set_status(app *a, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(a->status, sizeof a->status, fmt, ap);
    va_end(ap);
}

/* The request whose timeline is shown: the pinned one, else the followed one while it is live, else the
 * most recently active (live ones first). */
static uint64_t selected_request(app *a)
{
    const model *m = &a->m;
    const row *f, *best = NULL;
    size_t i;
    if (a->pinned) return a->pinned;
    f = a->followed ? find_row(m, a->followed) : NULL;
    if (f && is_live(f)) return a->followed;
    for (i = 0; i < m->nrows; i++) {
        const row *r = &m->rows[i];
        if (!best || (is_live(r) && !is_live(best)) ||
            (is_live(r) == is_live(best) && r->active_seq > best->active_seq))
            best = r;
    }
    a->followed = best ? best->request : 0;
    return a->followed;
}

static void send_command(app *a, const char *fmt, ...)
{
    char line[128];
    va_list ap;
    int n;
    if (a->sock < 0) {
        set_status(a, a->log_mode ? "a log is read-only: no engine to command" : "no engine to command");
        return;
    }
    va_start(ap, fmt);
    n = vsnprintf(line, sizeof line - 1, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof line - 1) return;
    set_status(a, "sent: %s", line);
    line[n++] = '\n';
    if (send(a->sock, line, (size_t)n, MSG_NOSIGNAL) != n) set_status(a, "could not send: %s", strerror(errno));
}

/* ---- rendering: one frame of text lines ---------------------------------------------------------- */

enum { MARK_NONE, MARK_BOLD, MARK_SELECTED };

typedef struct frame {
    char line[FRAME_LINES][LINE_BYTES];
    int mark[FRAME_LINES];
    int n;
} frame;

static void put(frame *f, int mark, const char *fmt, ...)
{
    va_list ap;
    if (f->n >= FRAME_LINES) return;
    va_start(ap, fmt);
    vsnprintf(f->line[f->n], LINE_BYTES, fmt, ap);
    va_end(ap);
    f->mark[f->n++] = mark;
}

static const char *state_name(uint32_t state)
{
    return state ? kvs_slot_state_name((kvs_slot_state)state) : "-";
}

static void pause_place(const kvs_event *e, char *out, size_t len)
{
    const char *where = e->u.pause.call ? kvs_call_name((kvs_call)e->u.pause.call)
                        : e->u.pause.state ? kvs_slot_state_name((kvs_slot_state)e->u.pause.state)
                                           : "?";
    if (e->request) snprintf(out, len, "%s (request %llu)", where, (unsigned long long)e->request);
    else snprintf(out, len, "%s", where);
}

/* One moment in a short human form (JSON for the kinds without one). */
static void describe_moment(const moment *mo, char *out, size_t len)
{
    const kvs_event *e = &mo->e;
    char where[96];
    size_t n = 0;
    switch (e->kind) {
    case KVS_EV_SLOT:
        snprintf(out, len, "%s -> %s  tokens %llu, computed %llu",
                 e->u.slot.from ? state_name(e->u.slot.from) : "(new)", state_name(e->u.slot.to),
                 (unsigned long long)e->u.slot.tokens, (unsigned long long)e->u.slot.computed);
        return;
    case KVS_EV_ADMIT:
        snprintf(out, len, "prompt %llu, hits %llu device + %llu lower, priority %d, preemptions %u",
                 (unsigned long long)e->u.admit.prompt_tokens, (unsigned long long)e->u.admit.device_hit_tokens,
                 (unsigned long long)e->u.admit.lower_hit_tokens, (int)e->u.admit.priority, e->u.admit.preemptions);
        return;
    case KVS_EV_ADD:
        snprintf(out, len, "prompt %llu tokens, max_new_tokens %u, priority %d",
                 (unsigned long long)e->u.add.num_prompt, e->u.add.max_new_tokens, (int)e->u.add.priority);
        return;
    case KVS_EV_APPEND:
        if (mo->count == 1) snprintf(out, len, "%llu token(s)", (unsigned long long)mo->tokens);
        else snprintf(out, len, "%llu tokens in %u calls, through #%llu", (unsigned long long)mo->tokens, mo->count,
                      (unsigned long long)mo->last_seq);
        return;
    case KVS_EV_FINISH:
    case KVS_EV_ABORT:
    case KVS_EV_RELEASE:
    case KVS_EV_RESUMED: out[0] = 0; return;
    case KVS_EV_PAUSED:
        pause_place(e, where, sizeof where);
        snprintf(out, len, "at %s", where);
        return;
    default:
        if (kvs_event_to_json(e, out, len, &n) != KVS_OK) snprintf(out, len, "(%zu bytes of JSON)", n);
        return;
    }
}

static void render_title(app *a, frame *f)
{
    const model *m = &a->m;
    char step[160] = "step -", banner[160] = "";
    if (m->step.kind)
        snprintf(step, sizeof step, "step %llu  waiting %u  running %u  swapped %u",
                 (unsigned long long)m->step.u.step.step, m->step.u.step.waiting, m->step.u.step.running,
                 m->step.u.step.swapped);
    if (model_paused(m)) {
        char where[96];
        pause_place(&m->paused, where, sizeof where);
        snprintf(banner, sizeof banner, "  [PAUSED at %s]", where);
    }
    put(f, MARK_BOLD, "kvtop — %s%s  %s%s", a->log_mode ? "log " : "", a->source, step, banner);
}

static int row_ptr_order(const void *a, const void *b) { return row_order(*(row *const *)a, *(row *const *)b); }

/* A tier's eviction policy, and for FOL on G1 the class step in use (self-tuning or fixed). */
static const char *policy_text(const model *m, uint32_t tier)
{
    static const char *const names[] = {"default", "lineage", "lru", "custom", "fol", "arc", "s3fifo"};
    static char text[48];
    uint32_t p = (m->tiers.u.tiers.policies >> (8 * tier)) & 0xffu;
    const char *name = p < sizeof names / sizeof names[0] ? names[p] : "?";
    if (p == KVB_EVICT_FOL && tier == 0)
        snprintf(text, sizeof text, "fol, step %u%s", m->tiers.u.tiers.device_step,
                 m->tiers.u.tiers.device_tails ? ", tails first" : "");
    else snprintf(text, sizeof text, "%s", name);
    return text;
}

/* The slot table in `room` lines (header included): live requests, then recently finished ones. */
static void render_slots(app *a, frame *f, int room, uint64_t sel)
{
    const model *m = &a->m;
    row **order = (row **)xrealloc(NULL, (m->nrows ? m->nrows : 1) * sizeof *order);
    size_t live = 0, i;
    for (i = 0; i < m->nrows; i++) {
        order[i] = &m->rows[i];
        live += is_live(&m->rows[i]);
    }
    qsort(order, m->nrows, sizeof *order, row_ptr_order);
    if (sel && room > 2 && m->nrows > (size_t)room - 2) { /* the selected request is always in the table */
        size_t last = (size_t)room - 3;
        for (i = 0; i < m->nrows && order[i]->request != sel; i++) {}
        if (i < m->nrows && i > last) order[last] = order[i];
    }
    put(f, MARK_BOLD, "Slots (%zu live, %zu finished)", live, m->nrows - live);
    put(f, MARK_NONE, "    request  %-15s %8s %8s %8s %8s", "state", "prompt", "tokens", "computed", "hits");
    a->nshown = 0;
    for (i = 0; i < m->nrows && (int)i < room - 2 && a->nshown < FRAME_LINES; i++) {
        const row *r = order[i];
        char prompt[24] = "-", hit[24] = "-";
        if (r->added || r->admitted) snprintf(prompt, sizeof prompt, "%llu", (unsigned long long)r->prompt);
        if (r->admitted) snprintf(hit, sizeof hit, "%llu", (unsigned long long)r->hit);
        put(f, r->request == sel ? MARK_SELECTED : MARK_NONE, "%s %9llu  %-15s %8s %8llu %8llu %8s",
            r->request == sel ? ">" : " ", (unsigned long long)r->request, state_name(r->state), prompt,
            (unsigned long long)(r->tokens + r->appended), (unsigned long long)r->computed, hit);
        a->shown[a->nshown++] = r->request;
    }
    if (!m->nrows) put(f, MARK_NONE, "  (no requests yet)");
    free(order);
}

static void render_tiers(const model *m, frame *f)
{
    uint32_t i, n = m->tiers.kind ? m->tiers.u.tiers.num_tiers : 0;
    char step[96] = "";
    if (m->step.kind)
        snprintf(step, sizeof step, "  (step: device %u/%u used)", m->step.u.step.device_used,
                 m->step.u.step.device_blocks);
    put(f, MARK_BOLD, "Tiers%s", step);
    if (n > 4) n = 4;
    for (i = 0; i < n; i++) {
        uint32_t used = m->tiers.u.tiers.used[i], total = m->tiers.u.tiers.total[i], k, fill;
        char bar[21];
        fill = total ? (uint32_t)((uint64_t)used * 20 / total) : 0;
        for (k = 0; k < 20; k++) bar[k] = k < fill ? '#' : '.';
        bar[20] = 0;
        put(f, MARK_NONE, "  G%u [%s] %9u/%-9u %5.1f%%  %s", i + 1, bar, used, total, percent(used, total),
            policy_text(m, i));
    }
    if (!n) put(f, MARK_NONE, "  (no occupancy reported yet)");
}

/* One line: count and blocks per direction (src, dst, onboard). */
static void render_transfers(const model *m, frame *f)
{
    struct dir { uint32_t src, dst, onboard, count; uint64_t blocks; } d[16];
    size_t nd = 0, i, j, at;
    char text[LINE_BYTES];
    for (i = 0; i < m->nxfers; i++) {
        const transfer *x = &m->xfers[i];
        for (j = 0; j < nd; j++)
            if (d[j].src == x->src && d[j].dst == x->dst && d[j].onboard == x->onboard) break;
        if (j == nd) {
            if (nd == sizeof d / sizeof d[0]) continue;
            d[nd].src = x->src;
            d[nd].dst = x->dst;
            d[nd].onboard = x->onboard;
            d[nd].count = 0;
            d[nd++].blocks = 0;
        }
        d[j].count++;
        d[j].blocks += x->blocks;
    }
    at = (size_t)snprintf(text, sizeof text, "Transfers in flight  %zu", m->nxfers);
    for (j = 0; j < nd && at < sizeof text; j++)
        at += (size_t)snprintf(text + at, sizeof text - at, "   G%u->G%u %s %u (%llu block%s)", d[j].src + 1,
                               d[j].dst + 1, d[j].onboard ? "up" : "down", d[j].count,
                               (unsigned long long)d[j].blocks, d[j].blocks == 1 ? "" : "s");
    put(f, MARK_BOLD, "%s", text);
}

static void render_hits(const model *m, frame *f)
{
    if (!m->admits) {
        put(f, MARK_BOLD, "hit rate -  (no admissions seen yet)");
        return;
    }
    put(f, MARK_BOLD, "hit rate %.1f%%  device %.1f%%  lower %.1f%%  (%llu admissions seen, %llu prompt tokens)",
        percent(m->device_hit_tokens + m->lower_hit_tokens, m->prompt_tokens),
        percent(m->device_hit_tokens, m->prompt_tokens), percent(m->lower_hit_tokens, m->prompt_tokens),
        (unsigned long long)m->admits, (unsigned long long)m->prompt_tokens);
}

static void render_timeline(const model *m, frame *f, uint64_t sel, uint32_t room)
{
    const row *r = sel ? find_row(m, sel) : NULL;
    uint32_t i;
    if (!r) {
        if (sel) put(f, MARK_BOLD, "Timeline request %llu (no events about it seen)", (unsigned long long)sel);
        else put(f, MARK_BOLD, "Timeline request -");
        return;
    }
    put(f, MARK_BOLD, "Timeline request %llu (%s)", (unsigned long long)sel, state_name(r->state));
    for (i = r->timeline_n > room ? r->timeline_n - room : 0; i < r->timeline_n; i++) {
        const kvs_event *e = &r->timeline[i].e;
        char text[LINE_BYTES - 64];
        describe_moment(&r->timeline[i], text, sizeof text);
        put(f, MARK_NONE, "  %+10.3fs  #%-8llu %-9s %s", (double)(e->time_ns - m->t0) * 1e-9,
            (unsigned long long)e->seq, kvs_event_kind_name((kvs_event_kind)e->kind), text);
    }
}

/* The last message, and whether the view may be incomplete. */
static void render_status(app *a, frame *f)
{
    const model *m = &a->m;
    char text[LINE_BYTES];
    size_t at = (size_t)snprintf(text, sizeof text, "%s%s%s", a->note, a->note[0] && a->status[0] ? "  " : "",
                                 a->status);
    if (m->missing && at < sizeof text)
        at += (size_t)snprintf(text + at, sizeof text - at, "%s%llu events missing (the view may be incomplete)",
                               at ? "  " : "", (unsigned long long)m->missing);
    if (m->bad_records && at < sizeof text)
        snprintf(text + at, sizeof text - at, "%s%llu bad records", at ? "  " : "", (unsigned long long)m->bad_records);
    put(f, MARK_NONE, "%s", text);
}

static const char *const help_line =
    "p pause  r resume  b break on state  R break on request  c clear  j/k select  a follow  q quit";

static void render(app *a, frame *f)
{
    const model *m = &a->m;
    uint64_t sel = selected_request(a);
    const row *r = sel ? find_row(m, sel) : NULL;
    uint32_t ntiers = m->tiers.kind ? (m->tiers.u.tiers.num_tiers > 4 ? 4 : m->tiers.u.tiers.num_tiers) : 0;
    uint32_t tl = r ? r->timeline_n : 0;
    int rest, room;
    /* title, blank, [slots], blank, tiers, transfers, hit rate, blank, timeline, status, help */
    rest = 2 + 1 + 1 + (int)(ntiers ? ntiers : 1) + 2 + 1 + 1 + (int)tl + 2;
    room = a->height - rest;
    if (room < 4) { /* a short terminal: the timeline gives way first */
        int give = 4 - room < (int)tl ? 4 - room : (int)tl;
        tl -= (uint32_t)give;
        room += give;
    }
    if (room < 3) room = 3;
    f->n = 0;
    render_title(a, f);
    put(f, MARK_NONE, "%s", "");
    render_slots(a, f, room, sel);
    put(f, MARK_NONE, "%s", "");
    render_tiers(m, f);
    render_transfers(m, f);
    render_hits(m, f);
    put(f, MARK_NONE, "%s", "");
    render_timeline(m, f, sel, tl);
    render_status(a, f);
    if (a->prompt_kind)
        put(f, MARK_BOLD, "%s: %.*s_", a->prompt_kind == 'b' ? "break on state or call" : "break on request id",
            (int)a->prompt_len, a->prompt);
    else
        put(f, MARK_NONE, "%s", help_line);
}

/* Copies at most `cols` display columns of s (UTF-8) to out. */
static size_t clip(const char *s, int cols, char *out)
{
    size_t i = 0;
    int c = 0;
    for (; s[i]; i++) {
        if (((unsigned char)s[i] & 0xc0) != 0x80 && c++ == cols) break;
        out[i] = s[i];
    }
    return i;
}

static void write_all(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return;
        p += w;
        n -= (size_t)w;
    }
}

/* Plain: the lines as they are. Styled: from the top-left corner, each line clipped to the width and
 * cleared to its end; the last two (status and keys) on the last two rows of the terminal. */
static void emit(const app *a, const frame *f)
{
    static char out[FRAME_LINES * (LINE_BYTES + 16) + 64];
    size_t at = 0;
    int i, n = f->n, body = n - 2;
    if (!a->styled) {
        for (i = 0; i < n; i++) printf("%s\n", f->line[i]);
        fflush(stdout);
        return;
    }
    at += (size_t)sprintf(out, "\033[H");
    for (i = 0; i < n; i++) {
        if (i < body && i >= a->height - 2) continue; /* too many lines: the bottom two stay */
        if (i == body) at += (size_t)sprintf(out + at, "\033[J\033[%d;1H", a->height > 1 ? a->height - 1 : 1);
        if (f->mark[i] == MARK_BOLD) at += (size_t)sprintf(out + at, "\033[1m");
        if (f->mark[i] == MARK_SELECTED) at += (size_t)sprintf(out + at, "\033[7m");
        at += clip(f->line[i], a->width, out + at);
        at += (size_t)sprintf(out + at, "\033[0m\033[K%s", i == n - 1 ? "" : "\r\n");
    }
    write_all(STDOUT_FILENO, out, at);
}

/* ---- input: the socket, the keyboard ------------------------------------------------------------- */

static void disconnect(app *a, const char *why)
{
    if (a->sock >= 0) close(a->sock);
    a->sock = -1;
    snprintf(a->note, sizeof a->note, "%s", why);
    a->status[0] = 0;
}

/* Reads what the socket has; 0 when the engine went away. */
static int read_socket(app *a)
{
    ssize_t n = recv(a->sock, a->in.buf + a->in.len, sizeof a->in.buf - a->in.len, 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return 1;
    if (n <= 0) {
        disconnect(a, "engine disconnected");
        return 0;
    }
    a->in.len += (size_t)n;
    if (stream_feed(&a->in, &a->m) != 0) {
        disconnect(a, "not a kvcache event stream (bad header): disconnected");
        a->not_a_console = 1;
        return 0;
    }
    return 1;
}

/* j / k: the next or previous request of the table as drawn; it stays selected. */
static void move_selection(app *a, int delta)
{
    uint64_t sel = selected_request(a);
    size_t i;
    if (!a->nshown) return;
    for (i = 0; i < a->nshown && a->shown[i] != sel; i++) {}
    if (i == a->nshown) i = 0;
    else if (delta > 0 && i + 1 < a->nshown) i++;
    else if (delta < 0 && i > 0) i--;
    a->pinned = a->shown[i];
    set_status(a, "request %llu selected (a: follow the most recently active)", (unsigned long long)a->pinned);
}

static void submit_prompt(app *a)
{
    char text[sizeof a->prompt + 1];
    int k;
    memcpy(text, a->prompt, a->prompt_len);
    text[a->prompt_len] = 0;
    if (a->prompt_kind == 'R') {
        char *end;
        unsigned long long id = strtoull(text, &end, 10);
        if (!text[0] || *end || !id) set_status(a, "'%s' is not a request id", text);
        else send_command(a, "break request %llu", id);
        return;
    }
    for (k = KVS_SLOT_INITIALIZED; k < KVS_SLOT__COUNT; k++)
        if (!strcasecmp(text, kvs_slot_state_name((kvs_slot_state)k))) {
            send_command(a, "break state %s", kvs_slot_state_name((kvs_slot_state)k));
            return;
        }
    for (k = KVS_CALL_ADD; k < KVS_CALL__COUNT; k++)
        if (!strcasecmp(text, kvs_call_name((kvs_call)k))) {
            send_command(a, "break call %s", kvs_call_name((kvs_call)k));
            return;
        }
    set_status(a, "'%s' is neither a slot state (Initialized .. Finished) nor a call (sched_step, ...)", text);
}

/* A key while the bottom line asks for a name or an id. */
static void prompt_key(app *a, unsigned char c)
{
    if (c == '\r' || c == '\n') {
        if (a->prompt_len) submit_prompt(a);
        a->prompt_kind = 0;
    } else if (c == 0x1b) {
        a->prompt_kind = 0;
        set_status(a, "cancelled");
    } else if (c == 127 || c == 8) {
        if (a->prompt_len) a->prompt_len--;
    } else if (c > ' ' && c < 127 && a->prompt_len < sizeof a->prompt - 1) {
        a->prompt[a->prompt_len++] = (char)c;
    }
}

/* Returns 1 to quit. */
static int handle_keys(app *a, const unsigned char *k, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) {
        if (a->prompt_kind) {
            prompt_key(a, k[i]);
            if (k[i] == 0x1b && i + 2 < n && k[i + 1] == '[') i += 2; /* an arrow: all of it */
            continue;
        }
        switch (k[i]) {
        case 'q': return 1;
        case 'p': send_command(a, "pause"); break;
        case 'r': send_command(a, "resume"); break;
        case 'c': send_command(a, "clear"); break;
        case 'b':
        case 'R':
            a->prompt_kind = (char)k[i];
            a->prompt_len = 0;
            break;
        case 'j': move_selection(a, 1); break;
        case 'k': move_selection(a, -1); break;
        case 'a':
            a->pinned = 0;
            a->followed = 0;
            set_status(a, "following the most recently active request");
            break;
        case 0x1b: /* ESC [ A / ESC [ B: the arrows */
            if (i + 2 < n && k[i + 1] == '[') {
                if (k[i + 2] == 'A') move_selection(a, -1);
                if (k[i + 2] == 'B') move_selection(a, 1);
                i += 2;
            }
            break;
        default: break;
        }
    }
    return 0;
}

/* ---- the terminal -------------------------------------------------------------------------------- */

static volatile sig_atomic_t quit_signal, resized;
static struct termios saved_termios;
static int raw_mode;

static void on_quit_signal(int sig) { quit_signal = sig; }
static void on_winch(int sig)
{
    (void)sig;
    resized = 1;
}

static void terminal_restore(void)
{
    static const char leave[] = "\033[0m\033[?25h\033[?1049l";
    if (!raw_mode) return;
    write_all(STDOUT_FILENO, leave, sizeof leave - 1);
    tcsetattr(STDIN_FILENO, TCSAFLUSH, &saved_termios);
    raw_mode = 0;
}

/* Keys one at a time, no echo; the alternate screen, the cursor hidden. Restored at exit. */
static int terminal_raw(void)
{
    static const char enter[] = "\033[?1049h\033[?25l\033[H\033[J";
    struct termios t;
    struct sigaction sa;
    if (tcgetattr(STDIN_FILENO, &saved_termios) != 0) return -1;
    t = saved_termios;
    t.c_lflag &= ~(tcflag_t)(ICANON | ECHO | IEXTEN);
    t.c_iflag &= ~(tcflag_t)(IXON | ICRNL);
    t.c_cc[VMIN] = 1;
    t.c_cc[VTIME] = 0;
    if (tcsetattr(STDIN_FILENO, TCSAFLUSH, &t) != 0) return -1;
    raw_mode = 1;
    atexit(terminal_restore);
    memset(&sa, 0, sizeof sa); /* no SA_RESTART: poll returns at once */
    sa.sa_handler = on_quit_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    sa.sa_handler = on_winch;
    sigaction(SIGWINCH, &sa, NULL);
    write_all(STDOUT_FILENO, enter, sizeof enter - 1);
    return 0;
}

static void terminal_size(app *a)
{
    struct winsize ws;
    if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_row && ws.ws_col) {
        a->height = ws.ws_row;
        a->width = ws.ws_col;
    }
}

/* ---- the two ways to run ------------------------------------------------------------------------- */

static frame the_frame;

/* Interactive: redraws at most every REDRAW_NS, waiting on the keyboard and the socket. */
static void run_interactive(app *a)
{
    uint64_t last_draw = 0;
    int dirty = 1;
    a->styled = 1;
    terminal_size(a);
    while (!quit_signal) {
        struct pollfd fds[2];
        int timeout = 1000;
        if (resized) {
            resized = 0;
            terminal_size(a);
            dirty = 1;
        }
        if (dirty) {
            uint64_t t = now_ns();
            if (t - last_draw >= REDRAW_NS) {
                render(a, &the_frame);
                emit(a, &the_frame);
                last_draw = t;
                dirty = 0;
            } else {
                timeout = (int)((REDRAW_NS - (t - last_draw)) / 1000000) + 1;
            }
        }
        fds[0].fd = STDIN_FILENO;
        fds[0].events = POLLIN;
        fds[1].fd = a->sock;
        fds[1].events = POLLIN;
        fds[0].revents = fds[1].revents = 0;
        if (poll(fds, 2, timeout) < 0) continue; /* a signal */
        if (a->sock >= 0 && (fds[1].revents & (POLLIN | POLLHUP | POLLERR))) {
            read_socket(a);
            dirty = 1;
        }
        if (fds[0].revents & (POLLIN | POLLHUP | POLLERR | POLLNVAL)) {
            unsigned char keys[64];
            ssize_t n = read(STDIN_FILENO, keys, sizeof keys);
            if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) break; /* the terminal is gone */
            if (n > 0 && handle_keys(a, keys, (size_t)n)) break;
            dirty = 1;
        }
    }
    terminal_restore();
}

/* --once on a socket: what arrives in ONCE_LIVE_NS. */
static void read_for_a_while(app *a)
{
    uint64_t end = now_ns() + ONCE_LIVE_NS;
    while (a->sock >= 0) {
        struct pollfd p;
        uint64_t t = now_ns();
        if (t >= end) break;
        p.fd = a->sock;
        p.events = POLLIN;
        p.revents = 0;
        if (poll(&p, 1, (int)((end - t) / 1000000) + 1) > 0) read_socket(a);
    }
}

static int load_log(app *a, const char *path)
{
    kvs_event *ev = NULL;
    size_t n = 0, i;
    kvs_log_report rep;
    int r;
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "kvtop: %s: %s\n", path, strerror(errno));
        return -1;
    }
    fclose(f);
    memset(&rep, 0, sizeof rep);
    r = kvs_log_read(path, &ev, &n, &rep);
    if (r != KVS_OK && r != KVS_ELOG) {
        fprintf(stderr, "kvtop: %s: %s\n", path, r == KVS_EIO ? "not a kvcache event log" : kvs_result_string(r));
        return -1;
    }
    for (i = 0; i < n; i++) model_apply(&a->m, &ev[i]);
    if (r == KVS_ELOG)
        snprintf(a->note, sizeof a->note, "log damaged at byte %llu (%s), %zu records kept",
                 (unsigned long long)rep.damaged_at, rep.truncated ? "truncated" : "corrupt", rep.records);
    else
        snprintf(a->note, sizeof a->note, "log: %zu records", rep.records ? rep.records : n);
    kvs_log_free(ev);
    return 0;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: kvtop [--once] [--request ID] SOCKET\n"
               "       kvtop [--once] [--request ID] --log FILE\n"
               "A terminal console for a kvcache engine (see the top of examples/kvtop.c).\n\n"
               "  SOCKET        attach to an engine's kvs_console Unix socket (serve_sim --console PATH)\n"
               "  --log FILE    read a recorder log instead (serve_sim --record FILE)\n"
               "  --once        print one plain-text frame of what is there (live: ~0.5 s) and exit\n"
               "  --request ID  show this request's timeline (default: the most recently active)\n"
               "  --help        this text\n\n"
               "keys: %s\n"
               "      b asks for a slot state (Decoding, ...) or a call (sched_step, ...), R for a request id\n",
            help_line);
}

static void usage_error(const char *fmt, const char *arg)
{
    fprintf(stderr, "kvtop: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, " (try --help)\n");
    exit(2);
}

/* Options into a; the socket or the log path into *socket_path / *log_path (exactly one). */
static void parse_args(int argc, char **argv, app *a, const char **socket_path, const char **log_path)
{
    int i;
    for (i = 1; i < argc; i++) {
        const char *o = argv[i];
        if (!strcmp(o, "--help") || !strcmp(o, "-h")) {
            usage(stdout);
            exit(0);
        } else if (!strcmp(o, "--once")) {
            a->once = 1;
        } else if (!strcmp(o, "--log")) {
            if (i + 1 >= argc) usage_error("%s needs a file", o);
            *log_path = argv[++i];
        } else if (!strcmp(o, "--request")) {
            char *end;
            const char *v = i + 1 < argc ? argv[++i] : "";
            errno = 0;
            a->pinned = strtoull(v, &end, 10);
            if (errno || !*v || *end || *v == '-' || !a->pinned) usage_error("--request: '%s' is not a request id", v);
        } else if (o[0] == '-') {
            usage_error("unknown option '%s'", o);
        } else if (*socket_path) {
            usage_error("one socket at a time ('%s' is one more)", o);
        } else {
            *socket_path = o;
        }
    }
    if (!*socket_path == !*log_path)
        usage_error("%s", *socket_path ? "a socket or --log, not both" : "give a socket or --log FILE");
}

int main(int argc, char **argv)
{
    static app a;
    const char *socket_path = NULL, *log_path = NULL;
    parse_args(argc, argv, &a, &socket_path, &log_path);
    a.sock = -1;
    a.width = 100;
    a.height = 40;
    a.log_mode = log_path != NULL;
    a.source = log_path ? log_path : socket_path;
    if (!a.once && (!isatty(STDIN_FILENO) || !isatty(STDOUT_FILENO))) {
        fprintf(stderr, "kvtop: the console needs a terminal; use --once for one plain-text frame\n");
        return 2;
    }
    if (log_path) {
        if (load_log(&a, log_path) != 0) return 1;
    } else {
        char why[256];
        if ((a.sock = console_connect(socket_path, why, sizeof why)) < 0) {
            fprintf(stderr, "kvtop: cannot attach to %s: %s\n", socket_path, why);
            return 1;
        }
        set_status(&a, "attached");
    }
    if (a.once) {
        if (a.sock >= 0) {
            read_for_a_while(&a);
            if (a.sock >= 0)
                set_status(&a, "attached: %llu events in %.1f s", (unsigned long long)a.m.events, ONCE_LIVE_NS * 1e-9);
        }
        if (isatty(STDOUT_FILENO)) terminal_size(&a);
        render(&a, &the_frame);
        emit(&a, &the_frame);
        if (a.not_a_console) { /* the frame says so; the socket could not be read */
            model_free(&a.m);
            return 1;
        }
    } else {
        if (terminal_raw() != 0) {
            fprintf(stderr, "kvtop: cannot set up the terminal: %s\n", strerror(errno));
            return 1;
        }
        run_interactive(&a);
        if (quit_signal) { /* the terminal is restored: end as the signal would have */
            signal(quit_signal, SIG_DFL);
            raise(quit_signal);
        }
    }
    if (a.sock >= 0) close(a.sock);
    model_free(&a.m);
    return 0;
}
