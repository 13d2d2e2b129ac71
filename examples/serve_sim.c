/* serve_sim.c — a continuous-batching serving simulation on kvcache: the kvsched.h scheduler and
 * connector, the kvoffload.h tier manager and the kvblock.h pools, driven by a synthetic chat workload
 * or a Mooncake trace, in simulated time. This is what `make demo` runs.
 *
 *   make build/serve_sim && ./build/serve_sim                      # synthetic workload, report
 *   ./build/serve_sim --trace examples/traces/small.jsonl --json   # a trace, one JSON object
 *   ./build/serve_sim --sequential --trace FILE --device-blocks 10000 --host-blocks 0   # pure replay
 *   ./build/serve_sim --pace-us 20000 --console /tmp/kv.sock & ./build/kvtop /tmp/kv.sock   # watch it
 *   ./build/serve_sim --trace FILE --engines auto --route kv     # a fleet sized from the load
 *   ./build/serve_sim --help
 *
 * Build by hand (drop -DKVO_WITH_REDIS and -lhiredis to build without the remote tier):
 *   cc -std=c11 -O2 -D_GNU_SOURCE -DKVO_WITH_REDIS -I. -I/usr/include/stb examples/serve_sim.c \
 *      examples/serve_sim/[a-z]*.c -o serve_sim -pthread -lcjson -lhiredis -lm
 *
 * FILES: this one holds the options and main (and compiles the library's implementation); the rest are
 * in examples/serve_sim/, one concern each, listed at the top of examples/serve_sim/sim.h: workload.c
 * (synthetic workload, trace loading), tiers.c (one engine's pools and tier manager), engine.c (the
 * scheduler loop of one engine), fleet.c (N engines and the router; offered load), replay.c
 * (--sequential, --check-lru), report.c (text, JSON), svg.c (--svg).
 *
 * WHAT IT DOES
 * Requests arrive (synthetic: conversations; trace: at their timestamps) and go to kvs_sched_add. Each
 * engine step is kvs_sched_step -> "forward pass" (time advances by the cost model below) ->
 * kvs_sched_complete -> one sampled token per request that finished its prompt or decoded
 * (kvs_sched_append). The scheduler matches prompts against the device prefix cache, asks the
 * connector for host / disk hits (onboarded before the request prefills), registers computed blocks and,
 * in eager mode, offers them down the tiers. Pools are metadata-only by default (a copy backend that
 * moves no bytes); --bytes gives every tier real storage: memcpy between device and host memory, the
 * disk backend with a file under /tmp (removed at exit) for the disk tier, and every cached block is
 * checked byte for byte against the pattern written when it was computed.
 * The report compares simulated TTFT with a second run of the same arrivals with the cache off (every
 * request salted apart, no lower tiers).
 *
 * HITS. prompt_blocks counts the full blocks of every prompt; a hit block is one the request did not
 * compute: a device hit, or a block onboarded from host or disk for it (in the scheduler, counted when
 * the request is admitted; a host / disk hit is a block that landed on the device by an onboard planned
 * for that request). As in vLLM, the scheduler never lets a hit cover a prompt's last token, so the last
 * block of a block-aligned prompt is always computed: with a trace (every hash id a full block) each
 * request's last block is a miss under the scheduler, as it would be for an engine given the real,
 * unaligned input_length; --sequential counts every id.
 *
 * --sequential is a pure cache replay with no scheduler: one request at a time, prompt blocks only, no
 * decode. Trace parsing, token synthesis and hashing happen first; the timed loop is, per request:
 * kvb_match on the device pool (longest prefix), kvo_manager_lookup for the rest and onboarding of
 * lower-tier hits (when there are lower tiers), kvb_alloc + kvb_register_hashed of the missing blocks
 * (chained to their parents), an eager offer of those to the tier below, and kvb_release of all of
 * them (deepest first). replay_seconds is the wall time of that loop alone: with the device pool alone
 * (no lower tier, no --bytes, no --svg), the median of --timing-runs runs (default 5), each on a fresh
 * pool with the same hits, alternating with the reference's runs under --check-lru (lru_seconds their
 * median), so that one noisy run of a loop of a few tens of milliseconds does not decide the ratio.
 * --check-lru replays the
 * same requests through a plain LRU prefix cache of --device-blocks blocks written here (a block hits
 * only if every earlier block of its request hit; a request's blocks all become most recent, deepest
 * first, as kvb_release orders them) and fails (exit 1) when the two hit rates differ by more than 0.005.
 *
 * COST MODEL (simulated time; constants below, Llama-3-8B fp16 on one H100 as the reference point)
 *   step with any work      COST_STEP_US                    5 ms   (launch, sampling, scheduling)
 *   prefill                 COST_PREFILL_US per token       60 us  (~16.7k tokens/s)
 *   decode                  COST_DECODE_US per sequence     40 us
 *   onboarding              KV_BYTES_PER_TOKEN / bandwidth  128 KiB per token; host 25 GB/s, disk 4 GB/s
 *   a step lasts max(compute, onboarding started in it): copies overlap compute on their own engine;
 *   a step with nothing to do lasts COST_IDLE_US (1 ms) so that pipelines waiting for a flush move on.
 *   Offloaded / onboarded bytes are real bytes with --bytes, otherwise blocks x block_tokens x 128 KiB
 *   ("modeled").
 *
 * WORKLOADS
 *   synthetic (default; --requests N, --seed S): SYN_SYSTEM system prompts (200..1200 tokens) chosen
 *   with Zipf(1.1) popularity; with probability 0.5 a shared document (one of SYN_DOCS, 300..1500
 *   tokens, Zipf(0.9)) follows it; then a multi-turn chat: 1 + Geometric turns (mean 3, at most 10), each
 *   a user message (16..200 tokens) and a reply (16..128 tokens). Turn k's prompt is the whole history,
 *   the replies included, so a returning turn reuses the blocks its previous turn computed. Conversations
 *   start as a Poisson process (SYN_RATE per second); a turn comes an exponential think time (mean
 *   SYN_THINK_S) after the previous one finished. 16-token blocks by default.
 *   Mooncake traces (--trace FILE): one JSON object a line, {"timestamp": ms, "input_length": n,
 *   "output_length": n, "hash_ids": [...]}; timestamps may count from anywhere (epoch milliseconds too:
 *   the clock starts at the first arrival); each hash id names one block of --block-tokens tokens
 *   (default 512) together with its whole prefix, and becomes that many synthetic tokens derived from
 *   (id, position); an input_length beyond the ids adds tokens unique to the request. output_length may
 *   be left out with --sequential, which never decodes. Malformed lines are reported (the first 5 with
 *   their line numbers, then how many of all the lines were malformed); a trace with more than 1% of its
 *   lines malformed does not run (exit 2), one with fewer (a long trace cut off mid-line) replays the
 *   rest with that warning; --skip-bad replays the good lines whatever their share (the report counts
 *   the others), --strict stops at the first. A compressed trace (gzip, zstd, xz, bzip2) stops at once with one message: decompress it.
 *
 * REMOTE TIER (--remote redis://host:port, or a seed list host:port,host:port for a Redis Cluster)
 * adds G4 (kvremote.h) as the last tier: a metadata-only pool standing for what Redis holds, the Redis
 * backend copying into it from the tier above and onboarding from it to the device. Blocks are keyed by
 * their hashes under the namespace "serve_sim" (salt 0), so runs of the same workload, in any process or
 * on any machine pointed at the same servers, share them. --remote implies --bytes (Redis stores real
 * bytes; every hit is checked byte for byte). With --disk-blocks too, all four tiers run at once:
 * G1 -> G2 -> G3 and G2 -> G4 (a manager branch: Redis is fed from host memory, never read back from
 * disk; kvoffload.h section 5 says why), so a disk tier needs --host-blocks. Onboarding from G4 is
 * modeled at REMOTE_GBPS (2.5 GB/s). Both modes look up device, host, disk, then Redis
 * (kvo_redis_tiers_lookup; the scheduler through its connector), the entries other runs stored
 * imported into G4 and onboarded; a load that fails (an entry gone, a node lost) is recomputed.
 * The reports gain remote_hit_blocks (prompt blocks whose hit came from G4: stored by this run and lost
 * from the device, or by an earlier run) and
 * remote_imported_blocks (blocks found in Redis that this run did not store). A second run of the same
 * workload against the same Redis, with cold local tiers, gets remote hits (tests/remote_sim.sh).
 * Built with -DKVO_WITH_REDIS -lhiredis (the Makefile does); without KVO_WITH_REDIS, --remote stops the
 * run at start with "remote tier not built in" (exit 2).
 *
 * FLEET (--engines N, --route POLICY; the scheduler mode). N engines, each a scheduler on its own device,
 * host and (when asked) disk pools, with G4 shared through Redis when --remote is given, run on one
 * simulated clock (each engine's clock is the end of its last step; the fleet takes arrivals and steps in
 * time order, examples/serve_sim/fleet.c). A kvs_router (kvroute.h) in front picks each request's engine
 * when it arrives: kv (default: least blocks to prefill + load), rr, least (least load), affinity
 * (the conversation on synthetic workloads; for traces the hash of the first blocks). Its index is fed
 * by each engine's pool events: what the engine holds in any of its own tiers, counted once per block,
 * so a conversation pushed down to host memory still draws its next turn. An engine's load is its
 * backlog (the prompt blocks routed to it that the router did not expect it to hold, until their first
 * token) plus 0.15 x the prompt blocks of the requests decoding there. The
 * report adds each engine's hit rate by tier, TTFT p50/p90/p99, prefill tokens, queue length (mean,
 * max; --json: sampled over time) and the imbalance (busiest engine's prefill tokens / the mean); --svg
 * draws the queues and the per-engine hit rates below the fleet's charts. The baseline (cache off) runs
 * on a fleet of the same size and policy. With one engine there is no router and the run is the one
 * serve_sim always made.
 * SHARDS (--shard I/N): this process serves only the conversations c with c mod N = I (a trace's requests
 * by number), so N processes started with I = 0 .. N - 1 split one workload; with --remote on one Redis
 * (Cluster) they share G4. --json then also carries ttft_ms, every request's TTFT, so that the shards'
 * reports merge. `make demo-fleet` (examples/demo_fleet.sh) runs three on a 3-node Redis Cluster next to
 * the same three alone; tests/fleet_cluster.sh also kills a node mid-run.
 * OFFERED LOAD. Before running, serve_sim compares the workload's offered load with the cost model:
 * prompt and output tokens per second in the busiest 600 s of (nominal) arrivals, or over all of them
 * when they span less, give the engines' worth of work without cache hits, work = (prompt/s x
 * COST_PREFILL_US + output/s x COST_DECODE_US) / 1e6 (step overheads amortise under load, so this is a
 * floor; the busiest window, because traces with a long quiet tail would hide their peak in the mean). The report prints it with the utilisation
 * work / N, and when work > N it warns on stderr: the fleet cannot keep up, its queues grow all run,
 * and every latency figure measures the backlog. --engines auto runs the smallest N with work / N < 0.8.
 *
 * OBSERVABILITY (the scheduler run with the cache on; not with --sequential, which stops with exit 2):
 *   --console PATH  publish every event on a kvs_bus (slot transitions, admissions, steps, block events of
 *                   every pool, transfer stages of every pipeline, tier occupancy) and serve it with
 *                   kvs_console on the Unix socket PATH: build/kvtop PATH watches the run, pauses it and
 *                   sets breakpoints.
 *   --record FILE   a kvs_recorder writing every event to the log FILE (build/kvtop --log FILE reads it;
 *                   kvs_replay can feed it back). Either option creates the bus; events carry simulated
 *                   time, so the same run records the same log.
 *   --metrics FILE  kvs_metrics_write's Prometheus text at the end of the run into FILE (- = stdout, after
 *                   the report).
 *   --pace-us N     sleep N microseconds of real time after every engine step, so that a person (or a
 *                   test) can watch: ./build/serve_sim --pace-us 20000 --console /tmp/kv.sock &
 *                   ./build/kvtop /tmp/kv.sock
 *   The baseline run (cache off) is neither observed nor paced. Without these options there is no bus.
 *   They observe one engine: with --engines N > 1 (or auto choosing more than one) they are refused.
 *
 * EXIT STATUS: 0 ok; 1 a check failed (--check-lru, --bytes data check); 2 bad usage or input.
 */
#define KVCACHE_IMPLEMENTATION /* the library's implementation is compiled in this file only */
#include "serve_sim/sim.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- options ------------------------------------------------------------------------------------ */

typedef struct named { const char *name; uint32_t value; } named;

/* --eviction NAME: a new pool policy is one more line here. */
static const named eviction_names[] = {
    {"lineage", KVB_EVICT_LINEAGE},
    {"fol", KVB_EVICT_FOL},
    {"lru", KVB_EVICT_LRU},
    {"arc", KVB_EVICT_ARC},
    {"s3fifo", KVB_EVICT_S3FIFO},
    {NULL, 0},
};
static const named route_names[] = {
    {"kv", KVS_ROUTE_KV},
    {"rr", KVS_ROUTE_ROUND_ROBIN},
    {"least", KVS_ROUTE_LEAST_LOADED},
    {"affinity", KVS_ROUTE_AFFINITY},
    {NULL, 0},
};
static const named offload_names[] = {
    {"eager", KVO_OFFLOAD_EAGER},
    {"lazy", KVO_OFFLOAD_LAZY},
    {NULL, 0},
};

typedef enum optkind { OPT_FLAG, OPT_U32, OPT_U64, OPT_STR, OPT_NAME } optkind;

typedef struct optdef {
    const char *name;
    optkind kind;
    size_t offset;
    const named *names; /* OPT_NAME */
    const char *arg, *help;
} optdef;

#define OPT(field) offsetof(options, field)
static const optdef optdefs[] = {
    {"--fol-step", OPT_U32, OPT(fol_step), NULL, "N", "FOL's class step in block references; 0 = self-tuning (default)"},
    {"--fol-ghost", OPT_U32, OPT(fol_ghost), NULL, "N", "FOL's ghost table (evicted hashes remembered); 0 = default"},
    {"--device-blocks", OPT_U32, OPT(device_blocks), NULL, "N", "device (G1) blocks; default 2048 (synthetic), 1024 (trace)"},
    {"--host-blocks", OPT_U32, OPT(host_blocks), NULL, "N", "host (G2) blocks, 0 = no host tier; default 16384 / 8192"},
    {"--disk-blocks", OPT_U32, OPT(disk_blocks), NULL, "N", "disk (G3) blocks, 0 = no disk tier (default)"},
    {"--block-tokens", OPT_U32, OPT(block_tokens), NULL, "N", "tokens per block; default 16 (synthetic), 512 (trace)"},
    {"--eviction", OPT_NAME, OPT(eviction), eviction_names, "NAME", "device pool eviction policy (default lineage)"},
    {"--offload", OPT_NAME, OPT(offload), offload_names, "MODE", "offload to lower tiers (default eager)"},
    {"--seed", OPT_U64, OPT(seed), NULL, "N", "synthetic workload seed (default 1)"},
    {"--requests", OPT_U32, OPT(requests), NULL, "N", "synthetic workload size (default 5000)"},
    {"--trace", OPT_STR, OPT(trace), NULL, "FILE", "replay a Mooncake JSONL trace instead"},
    {"--skip-bad", OPT_FLAG, OPT(skip_bad), NULL, NULL, "replay a trace's good lines however many are malformed (default: exit 2 above 1%)"},
    {"--strict", OPT_FLAG, OPT(strict), NULL, NULL, "stop at the first malformed trace line"},
    {"--sequential", OPT_FLAG, OPT(sequential), NULL, NULL, "pure cache replay: one request at a time, prompts only"},
    {"--check-lru", OPT_FLAG, OPT(check_lru), NULL, NULL, "compare the replay with a reference LRU cache (implies --sequential)"},
    {"--timing-runs", OPT_U32, OPT(timing_runs), NULL, "N",
     "--sequential with the device pool alone: time the loop N times (the reference's too), median (default 5)"},
    {"--bytes", OPT_FLAG, OPT(bytes), NULL, NULL, "memory-backed pools, disk tier in a /tmp file, data checked"},
    {"--remote", OPT_STR, OPT(remote), NULL, "URL", "G4 tier in Redis, last: redis://host:port[,host:port...] (implies --bytes)"},
    {"--engines", OPT_STR, OPT(engines_arg), NULL, "N|auto", "engines in the fleet, each with its own tiers (default 1); auto: sized from the load"},
    {"--route", OPT_NAME, OPT(route), route_names, "POLICY", "how the fleet's router picks an engine (default kv)"},
    {"--shard", OPT_STR, OPT(shard_arg), NULL, "I/N", "serve only conversations c with c mod N = I (one process of N)"},
    {"--json", OPT_FLAG, OPT(json), NULL, NULL, "print one JSON object instead of the text report"},
    {"--svg", OPT_STR, OPT(svg), NULL, "FILE", "write a chart of hit rate and tier occupancy over time"},
    {"--console", OPT_STR, OPT(console), NULL, "PATH", "serve kvs_console on this Unix socket (build/kvtop PATH attaches)"},
    {"--record", OPT_STR, OPT(record), NULL, "FILE", "record every event to a log (build/kvtop --log FILE reads it)"},
    {"--metrics", OPT_STR, OPT(metrics), NULL, "FILE", "write the Prometheus metrics at the end of the run, - = stdout"},
    {"--pace-us", OPT_U32, OPT(pace_us), NULL, "N", "sleep N real microseconds after every engine step (default 0)"},
    {"--help", OPT_FLAG, OPT(help), NULL, NULL, "this text"},
};
#define NOPTS (sizeof optdefs / sizeof optdefs[0])

static const char *name_of(const named *t, uint32_t v)
{
    for (; t->name; t++)
        if (t->value == v) return t->name;
    return "?";
}

const char *eviction_name(uint32_t policy) { return name_of(eviction_names, policy); }
const char *offload_name(uint32_t mode) { return name_of(offload_names, mode); }
const char *route_name(uint32_t policy) { return name_of(route_names, policy); }

static void usage(FILE *f)
{
    size_t i;
    fprintf(f, "usage: serve_sim [options]\n"
               "A continuous-batching serving simulation on kvcache (see the top of examples/serve_sim.c).\n\n");
    for (i = 0; i < NOPTS; i++) {
        const optdef *d = &optdefs[i];
        char lhs[64];
        snprintf(lhs, sizeof lhs, "%s%s%s", d->name, d->arg ? " " : "", d->arg ? d->arg : "");
        fprintf(f, "  %-22s %s", lhs, d->help);
        if (d->names) {
            const named *n;
            fprintf(f, ":");
            for (n = d->names; n->name; n++) fprintf(f, " %s", n->name);
        }
        fputc('\n', f);
    }
}

static void parse_value(const optdef *d, const char *v, options *o)
{
    char *end;
    void *field = (char *)o + d->offset;
    unsigned long long x;
    const named *n;
    switch (d->kind) {
    case OPT_FLAG: *(int *)field = 1; return;
    case OPT_STR: *(const char **)field = v; return;
    case OPT_NAME:
        for (n = d->names; n->name; n++)
            if (!strcmp(n->name, v)) {
                *(uint32_t *)field = n->value;
                return;
            }
        die(2, "%s: unknown value '%s' (try --help)", d->name, v);
        return;
    case OPT_U32:
    case OPT_U64:
        errno = 0; /* digits only: strtoull skips blanks and takes a sign (" -1" was 2^64 - 1) */
        x = strtoull(v, &end, 10);
        if (errno || end == v || *end || !isdigit((unsigned char)v[0]) || (d->kind == OPT_U32 && x >= UINT32_MAX))
            die(2, "%s: '%s' is not a valid number", d->name, v);
        if (d->kind == OPT_U32) *(uint32_t *)field = (uint32_t)x;
        else *(uint64_t *)field = (uint64_t)x;
        return;
    }
}

/* --engines N (1 .. MAX_ENGINES) or auto (o->engines 0 until main sizes the fleet from the workload). */
static void parse_engines(options *o)
{
    char *end;
    unsigned long n;
    o->engines = 1;
    if (!o->engines_arg) return;
    if (!strcmp(o->engines_arg, "auto")) {
        o->engines = 0;
    } else {
        errno = 0;
        n = strtoul(o->engines_arg, &end, 10);
        if (errno || end == o->engines_arg || *end || o->engines_arg[0] == '-' || n < 1 || n > MAX_ENGINES)
            die(2, "--engines: '%s' is not auto or a number 1..%d", o->engines_arg, MAX_ENGINES);
        o->engines = (uint32_t)n;
    }
    if (o->engines == 1 || (!o->engines && !o->sequential)) return; /* auto: size_fleet checks what it chose */
    if (o->sequential) die(2, "--sequential replays one cache: drop --engines (or --check-lru, which implies --sequential)");
    if (o->console || o->record || o->metrics)
        die(2, "--console, --record and --metrics observe one engine: drop --engines");
}

/* --shard I/N: 0 <= I < N. */
static void parse_shard(options *o)
{
    unsigned long i = 0, n = 0;
    char *slash = NULL, *end = NULL;
    o->shard = 0;
    o->shards = 1;
    if (!o->shard_arg) return;
    errno = 0;
    if (isdigit((unsigned char)o->shard_arg[0])) i = strtoul(o->shard_arg, &slash, 10);
    if (slash && *slash == '/' && isdigit((unsigned char)slash[1])) n = strtoul(slash + 1, &end, 10);
    if (errno || !end || *end || !n || i >= n || n > 1u << 20) /* strtoul wraps nothing: ERANGE */
        die(2, "--shard: '%s' is not I/N with 0 <= I < N <= %u", o->shard_arg, 1u << 20);
    o->shard = (uint32_t)i;
    o->shards = (uint32_t)n;
}

static void parse_options(int argc, char **argv, options *o)
{
    int i;
    memset(o, 0, sizeof *o);
    o->device_blocks = o->host_blocks = o->disk_blocks = o->block_tokens = o->requests = UNSET;
    o->eviction = o->offload = o->route = o->timing_runs = UNSET;
    o->seed = 1;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i], *eq = strchr(a, '=');
        size_t len = eq ? (size_t)(eq - a) : strlen(a), k;
        for (k = 0; k < NOPTS; k++)
            if (strlen(optdefs[k].name) == len && !strncmp(optdefs[k].name, a, len)) break;
        if (k == NOPTS) die(2, "unknown option '%s' (try --help)", a);
        if (optdefs[k].kind == OPT_FLAG) {
            if (eq) die(2, "%s takes no value", optdefs[k].name);
            parse_value(&optdefs[k], NULL, o);
        } else if (eq) {
            parse_value(&optdefs[k], eq + 1, o);
        } else {
            if (i + 1 >= argc) die(2, "%s needs a value (try --help)", optdefs[k].name);
            parse_value(&optdefs[k], argv[++i], o);
        }
    }
    if (o->help) return;
    if (o->check_lru) o->sequential = 1;
    if (o->block_tokens == UNSET) o->block_tokens = o->trace ? 512 : 16;
    if (o->device_blocks == UNSET) o->device_blocks = o->trace ? 1024 : 2048;
    if (o->host_blocks == UNSET) o->host_blocks = o->trace ? 8192 : 16384;
    if (o->disk_blocks == UNSET) o->disk_blocks = 0;
    if (o->requests == UNSET) o->requests = 5000;
    if (o->timing_runs == UNSET) o->timing_runs = 5;
    if (o->eviction == UNSET) o->eviction = o->check_lru ? KVB_EVICT_LRU : KVB_EVICT_LINEAGE;
    if (o->offload == UNSET) o->offload = KVO_OFFLOAD_EAGER;
    if (o->route == UNSET) o->route = KVS_ROUTE_KV;
    parse_engines(o);
    parse_shard(o);
    if (!o->device_blocks) die(2, "--device-blocks must be at least 1");
    if (!o->timing_runs || o->timing_runs > 99) die(2, "--timing-runs must be 1..99");
    if (!o->block_tokens || o->block_tokens > 32768) die(2, "--block-tokens must be 1..32768");
    if (!o->requests && !o->trace) die(2, "--requests must be at least 1");
    if (o->strict && o->skip_bad) die(2, "--strict stops at a malformed line, --skip-bad replays past them: choose one");
    if (o->check_lru && (o->host_blocks || o->disk_blocks))
        die(2, "--check-lru compares the device pool alone with the reference: add --host-blocks 0 --disk-blocks 0");
    if (o->sequential && (o->console || o->record || o->metrics || o->pace_us))
        die(2, "--console, --record, --metrics and --pace-us observe the scheduler: drop --sequential%s",
            o->check_lru ? " and --check-lru (it implies --sequential)" : "");
    if ((o->console && !*o->console) || (o->record && !*o->record) || (o->metrics && !*o->metrics))
        die(2, "--console, --record and --metrics need a path");
    if (o->remote) {
        if (!*o->remote) die(2, "--remote needs redis://host:port");
        if (o->check_lru) die(2, "--check-lru compares the device pool alone with the reference: drop --remote");
        if (o->disk_blocks && !o->host_blocks) /* G4 is fed from G2 (a memory tier), beside G3 */
            die(2, "--remote with --disk-blocks needs a host tier (--host-blocks N): Redis is fed from host memory");
        o->bytes = 1; /* Redis stores real bytes: every pool above it is memory-backed */
    }
}

/* --engines auto: the smallest fleet under 0.8 utilisation without hits. A fleet too small for the load
 * is said on stderr (the reports say it too): its queues grow for the whole run and every latency
 * figure measures the backlog, not the cache. */
static void size_fleet(options *o, const capacity *c)
{
    uint32_t need = engines_for(c);
    if (!o->engines) {
        o->engines = need;
        if (o->engines > 1 && (o->console || o->record || o->metrics))
            die(2, "--engines auto chose %u engines: --console, --record and --metrics observe one engine", need);
    }
    if (c->work > o->engines)
        fprintf(stderr, "serve_sim: warning: offered load %.0f prompt tokens/s (+%.0f output) is %.2f engines' work "
                        "without cache hits; %u engine%s cannot keep up, queues grow all run and TTFT measures the "
                        "backlog (--engines auto would run %u)\n",
                c->prompt_tps, c->output_tps, c->work, o->engines, o->engines == 1 ? "" : "s", need);
}

int main(int argc, char **argv)
{
    options o;
    workload w;
    results res, base;
    series sv;
    fleet_report fr;
    capacity cap;
    int status = 0, lru_failed = 0;
    parse_options(argc, argv, &o);
    if (o.help) {
        usage(stdout);
        return 0;
    }
    load_workload(&w, &o);
    if (o.remote) { /* G4 remembers every block the workload could compute (at least 1024, at most 4 Mi) */
        uint64_t total = 0;
        size_t q;
        for (q = 0; q < w.n; q++) total += w.reqs[q].num_blocks;
        o.remote_blocks = (uint32_t)(total < 1024 ? 1024 : total > (UINT64_C(1) << 22) ? (UINT64_C(1) << 22) : total);
    }
    memset(&res, 0, sizeof res);
    memset(&base, 0, sizeof base);
    memset(&sv, 0, sizeof sv);
    memset(&fr, 0, sizeof fr);
    cap = offered_load(&w);
    if (!o.sequential) size_fleet(&o, &cap);
    if (o.sequential) {
        replay(&w, &o, &res, o.svg ? &sv : NULL);
        if (o.check_lru) {
            res.lru_rate = reference_lru(&w, o.device_blocks, &res.lru_seconds);
            res.lru_checked = 1;
            lru_failed = fabs(ratio(res.hit_blocks, res.prompt_blocks) - res.lru_rate) > 0.005;
        }
        replay_timing_rounds(&w, &o, &res);
    } else {
        int progress = isatty(STDERR_FILENO);
        run_fleet(&w, &o, 1, &res, &fr, o.svg ? &sv : NULL, progress);
        run_fleet(&w, &o, 0, &base, NULL, NULL, progress);
        res.ttft_nocache = base.ttft;
        res.nttft_nocache = base.nttft;
    }
    if (res.mismatches || lru_failed) status = 1;
    if (o.svg) {
        char title[300];
        describe(title, sizeof title, &w, &o);
        if (write_svg(o.svg, &sv, o.sequential ? NULL : &fr, title, o.sequential ? "requests replayed" : "simulated seconds") != 0)
            die(2, "%s: %s", o.svg, strerror(errno));
    }
    if (o.json) {
        print_json(&w, &o, &res, o.sequential ? NULL : &fr, &cap);
    } else {
        print_text(&w, &o, &res, o.sequential ? NULL : &fr, &cap);
        if (o.check_lru || o.bytes) { /* the summary line tests/run.sh adds up */
            int failed = (res.mismatches > 0) + lru_failed;
            int checks = (o.check_lru != 0) + (o.bytes != 0);
            printf("%d passed, %d failed\n", checks - failed, failed);
        }
    }
    if (res.metrics) { /* after the report: --metrics - puts it last on stdout */
        FILE *f = strcmp(o.metrics, "-") ? fopen(o.metrics, "w") : stdout;
        if (!f || fputs(res.metrics, f) < 0 || (f != stdout && fclose(f) != 0))
            die(2, "--metrics %s: %s", o.metrics, strerror(errno));
        free(res.metrics);
    }
    fleet_report_free(&fr);
    free(res.ttft);
    free(res.cpu);
    free(base.ttft);
    free(base.cpu);
    free(sv.s);
    free_workload(&w);
    return status;
}
