/* report.c — serve_sim's reports: text, and one JSON object with --json */
#include "sim.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

const char *const tier_names[TIER_ALL] = {"device", "host", "disk", "remote"};

/* ---- reports ------------------------------------------------------------------------------------ */

double ratio(uint64_t a, uint64_t b) { return b ? (double)a / (double)b : 0.0; }

static void human_bytes(char *out, size_t len, uint64_t v)
{
    const char *unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double x = (double)v;
    int u = 0;
    while (x >= 1024 && u < 4) {
        x /= 1024;
        u++;
    }
    snprintf(out, len, u ? "%.1f %s" : "%.0f %s", x, unit[u]);
}

typedef struct summary { double p50, p90, p99; } summary;
static summary ttft_summary(double *v, size_t n)
{
    summary s;
    s.p50 = percentile(v, n, 50) * 1e3;
    s.p90 = percentile(v, n, 90) * 1e3;
    s.p99 = percentile(v, n, 99) * 1e3;
    return s;
}

void describe(char *out, size_t len, const workload *w, const options *o)
{
    char shard[48] = "";
    if (o->shards > 1) snprintf(shard, sizeof shard, " (shard %u/%u)", o->shard, o->shards);
    if (w->is_trace)
        snprintf(out, len, "trace %s: %zu requests%s (%zu malformed lines skipped, %zu end inside their last block), "
                 "%u tokens per block", o->trace, w->n, shard, w->malformed, w->partial_last, o->block_tokens);
    else if (o->shards > 1) /* the conversation count is the whole workload's */
        snprintf(out, len, "synthetic workload, seed %llu: %zu requests%s, %u tokens per block",
                 (unsigned long long)o->seed, w->n, shard, o->block_tokens);
    else
        snprintf(out, len, "synthetic workload, seed %llu: %zu requests in %zu conversations, %u tokens per block",
                 (unsigned long long)o->seed, w->n, w->nconv, o->block_tokens);
}

/* Busiest engine's prefill work over the mean (1 = balanced; 0 without prefill). */
static double prefill_imbalance(const fleet_report *fr)
{
    double sum = 0, max = 0;
    uint32_t i;
    for (i = 0; i < fr->n; i++) {
        double p = (double)fr->engine[i].prefill_tokens;
        sum += p;
        if (p > max) max = p;
    }
    return sum > 0 ? max / (sum / fr->n) : 0;
}

/* Offered load against the fleet's capacity, and whether the fleet is too small for it. */
static void print_load(const options *o, const capacity *c)
{
    if (c->span_s <= 0) {
        printf("%-22s all requests arrive at once: no rate to compare with capacity\n", "offered load");
        return;
    }
    printf("%-22s %.0f prompt tokens/s + %.0f output tokens/s in the busiest %.0f s of %.0f: %.2f engines' work "
           "without cache hits (%.2f over the whole span)\n",
           "offered load", c->prompt_tps, c->output_tps, c->window_s, c->span_s, c->work, c->mean_work);
    printf("%-22s %u engine%s%s, route %s, %.0f prefill tokens/s each: utilisation %.2f without hits%s\n", "fleet",
           o->engines, o->engines == 1 ? "" : "s", o->engines_arg && !strcmp(o->engines_arg, "auto") ? " (auto)" : "",
           route_name(o->route), c->engine_tps, c->work / o->engines,
           c->work > o->engines ? " -- OVERLOADED: the load exceeds the fleet's capacity" : "");
}

/* One line per engine: hit rates by tier, TTFT, prefill work, queue. */
static void print_engines(const options *o, const fleet_report *fr)
{
    int k, nk = o->remote ? TIER_ALL : TIER_KINDS;
    uint32_t i;
    printf("%-8s %9s %8s", "engine", "requests", "hit rate");
    for (k = 0; k < nk; k++) printf(" %7s", tier_names[k]);
    printf("   TTFT p50 / p90 / p99 ms        prefill tokens  queue mean  max\n");
    for (i = 0; i < fr->n; i++) {
        results *e = &fr->engine[i];
        summary s = ttft_summary(e->ttft, e->nttft);
        printf("%-8u %9llu %8.4f", i, (unsigned long long)e->requests, ratio(e->hit_blocks, e->prompt_blocks));
        for (k = 0; k < nk; k++) printf(" %7.4f", ratio(e->tier_hits[k], e->prompt_blocks));
        printf("   %8.1f %9.1f %9.1f   %14llu  %10.2f %4u\n", s.p50, s.p90, s.p99,
               (unsigned long long)e->prefill_tokens, e->queue_mean, e->queue_max);
    }
    printf("%-22s busiest engine's prefill work / mean %.3f\n", "imbalance", prefill_imbalance(fr));
}

void print_text(const workload *w, const options *o, results *r, const fleet_report *fr, const capacity *cap)
{
    char d[256], b1[32];
    int k, first, nk = o->remote ? TIER_ALL : TIER_KINDS;
    uint32_t bt = o->block_tokens;
    describe(d, sizeof d, w, o);
    printf("serve_sim — %s\n", d);
    printf("  pools: device %u blocks (%s eviction), host %u, disk %u — %s; offload %s%s\n\n", o->device_blocks,
           eviction_name(o->eviction), o->host_blocks, o->disk_blocks,
           o->bytes ? "memory-backed (--bytes)" : "metadata only", offload_name(o->offload),
           o->sequential ? "; sequential replay, no scheduler" : "");
    if (o->remote) printf("  remote (G4): Redis at %s, namespace serve_sim\n\n", o->remote);
    if (fr) print_load(o, cap);
    if (o->sequential) printf("%-22s %llu replayed\n", "requests", (unsigned long long)r->requests);
    else
        printf("%-22s %llu finished (%llu too big for the device pool)\n", "requests", (unsigned long long)r->requests,
               (unsigned long long)r->skipped);
    printf("%-22s %12llu blocks %14llu tokens\n", "prompt blocks", (unsigned long long)r->prompt_blocks,
           (unsigned long long)r->prompt_blocks * bt);
    printf("%-22s %12llu blocks %14llu tokens   hit rate %.4f\n", "hit blocks", (unsigned long long)r->hit_blocks,
           (unsigned long long)r->hit_blocks * bt, ratio(r->hit_blocks, r->prompt_blocks));
    for (k = 0; k < nk; k++)
        printf("  %-20s %12llu blocks %14llu tokens            %.4f%s\n", tier_names[k],
               (unsigned long long)r->tier_hits[k], (unsigned long long)r->tier_hits[k] * bt,
               ratio(r->tier_hits[k], r->prompt_blocks), r->tr.present[k] ? "" : "   (no such tier)");
    printf("%-22s", "evictions");
    for (k = 0; k < nk; k++)
        if (r->tr.present[k]) printf(" %s %llu ", tier_names[k], (unsigned long long)r->tr.evictions[k]);
    printf("\n");
    if (o->eviction == KVB_EVICT_FOL) /* the step in use at the end: chosen online unless --fol-step gave one */
        printf("%-22s %u block references%s, tails %s\n", "FOL class step", r->tr.device_step,
               o->fol_step ? " (--fol-step)" : " (self-tuning)",
               r->tr.device_tails ? "first" : "one step before class 1");
    for (k = 0, first = 1; k < nk; k++) {
        char lbl[32];
        if (r->tr.down_from[k] < 0) continue;
        snprintf(lbl, sizeof lbl, "%s -> %s", tier_names[r->tr.down_from[k]], tier_names[k]);
        human_bytes(b1, sizeof b1, r->tr.down_bytes[k]);
        printf("%-22s %-16s %10llu blocks %12s%s\n", first ? "offloaded" : "", lbl,
               (unsigned long long)r->tr.down_blocks[k], b1, o->bytes ? "" : " (modeled)");
        first = 0;
    }
    for (k = 1; k < nk; k++) {
        char lbl[32];
        if (!r->tr.present[k]) continue;
        snprintf(lbl, sizeof lbl, "%s -> device", tier_names[k]);
        human_bytes(b1, sizeof b1, r->tr.up_bytes[k]);
        printf("%-22s %-16s %10llu blocks %12s%s\n", "onboarded", lbl, (unsigned long long)r->tr.up_blocks[k], b1,
               o->bytes ? "" : " (modeled)");
    }
    if (o->bytes)
        printf("%-22s %llu cached blocks checked byte for byte, %llu mismatches\n", "data check",
               (unsigned long long)r->verified, (unsigned long long)r->mismatches);
    if (r->disk_note[0]) printf("%-22s %s\n", "disk tier", r->disk_note);
    if (o->remote)
        printf("%-22s %llu blocks found in Redis that this run did not store; %llu checksum errors, %llu I/O errors\n",
               "remote tier", (unsigned long long)r->tr.redis.imported, (unsigned long long)r->tr.redis.checksum_errors,
               (unsigned long long)r->tr.redis.io_errors);
    if (o->remote && (r->tr.redis.misses || r->tr.redis.io_errors || r->tr.redis.remote_errors ||
                      r->tr.redis.lookup_errors || r->tr.redis.disconnects || r->tr.redis.connect_failures))
        printf("%-22s %llu reads found no entry, %llu copies failed (%llu I/O, %llu error replies), %llu lookups failed, "
               "%llu connections lost, %llu refused: those loads were recomputed\n", "remote tier lost",
               (unsigned long long)r->tr.redis.misses,
               (unsigned long long)(r->tr.redis.io_errors + r->tr.redis.remote_errors),
               (unsigned long long)r->tr.redis.io_errors, (unsigned long long)r->tr.redis.remote_errors,
               (unsigned long long)r->tr.redis.lookup_errors, (unsigned long long)r->tr.redis.disconnects,
               (unsigned long long)r->tr.redis.connect_failures);
    if (o->sequential) {
        printf("%-22s %.6f s for %llu prompt blocks: %.1f ns per block", "replay loop", r->replay_seconds,
               (unsigned long long)r->prompt_blocks, r->prompt_blocks ? r->replay_seconds * 1e9 / (double)r->prompt_blocks : 0.0);
        if (r->timing_runs > 1) printf(" (median of %u runs, a fresh pool each)", r->timing_runs);
        printf("\n");
        if (r->lru_checked) {
            double pool = ratio(r->hit_blocks, r->prompt_blocks), diff = fabs(pool - r->lru_rate);
            printf("%-22s %.4f, pool (%s) %.4f: difference %.4f, %s\n", "LRU reference", r->lru_rate,
                   eviction_name(o->eviction), pool, diff, diff <= 0.005 ? "match (<= 0.005)" : "MISMATCH (> 0.005)");
            printf("%-22s %.6f s: %.1f ns per block; the pool's replay loop took %.2f times as long\n",
                   "reference loop", r->lru_seconds,
                   r->prompt_blocks ? r->lru_seconds * 1e9 / (double)r->prompt_blocks : 0.0,
                   r->lru_seconds > 0 ? r->replay_seconds / r->lru_seconds : 0.0);
        }
    } else {
        summary a = ttft_summary(r->ttft, r->nttft), b = ttft_summary(r->ttft_nocache, r->nttft_nocache);
        double mean = 0;
        size_t i;
        printf("%-22s with cache     p50 %9.1f ms   p90 %9.1f ms   p99 %9.1f ms\n", "TTFT (simulated)", a.p50, a.p90,
               a.p99);
        printf("%-22s without cache  p50 %9.1f ms   p90 %9.1f ms   p99 %9.1f ms\n", "", b.p50, b.p90, b.p99);
        for (i = 0; i < r->ncpu; i++) mean += r->cpu[i];
        mean = r->ncpu ? mean / (double)r->ncpu : 0;
        printf("%-22s %llu steps, %llu preemptions; CPU per step (kvs_sched_step + complete): mean %.1f us, p99 %.1f us\n",
               "scheduler", (unsigned long long)r->steps, (unsigned long long)r->preempted, mean * 1e6,
               percentile(r->cpu, r->ncpu, 99) * 1e6);
        printf("%-22s %.1f s simulated in %.2f s (with cache)\n", "time", r->sim_seconds, r->wall_seconds);
        if (fr && fr->n > 1) print_engines(o, fr);
    }
}

static void json_num(cJSON *o, const char *k, double v) { cJSON_AddItemToObject(o, k, isfinite(v) ? cJSON_CreateNumber(v) : cJSON_CreateNull()); }

static void json_tier_hits(cJSON *j, const options *o, const results *r)
{
    char key[96];
    int k, nk = o->remote ? TIER_ALL : TIER_KINDS;
    uint32_t bt = o->block_tokens;
    for (k = 0; k < nk; k++) {
        snprintf(key, sizeof key, "%s_hit_blocks", tier_names[k]);
        json_num(j, key, (double)r->tier_hits[k]);
        snprintf(key, sizeof key, "%s_hit_tokens", tier_names[k]);
        json_num(j, key, (double)r->tier_hits[k] * bt);
        snprintf(key, sizeof key, "%s_hit_rate", tier_names[k]);
        json_num(j, key, ratio(r->tier_hits[k], r->prompt_blocks));
    }
}

/* The fleet: offered load, capacity, and each engine (hit rates by tier, TTFT, prefill work, queue over
 * time as the report's samples). */
static void json_fleet(cJSON *j, const options *o, const fleet_report *fr, const capacity *c)
{
    cJSON *arr, *qt, *ql;
    uint32_t i;
    size_t q;
    json_num(j, "engines", o->engines);
    cJSON_AddBoolToObject(j, "engines_auto", o->engines_arg && !strcmp(o->engines_arg, "auto"));
    cJSON_AddStringToObject(j, "route", route_name(o->route));
    json_num(j, "offered_seconds", c->span_s);
    json_num(j, "offered_window_seconds", c->window_s);
    json_num(j, "offered_mean_work_engines", c->mean_work);
    json_num(j, "offered_prompt_tokens_per_s", c->prompt_tps);
    json_num(j, "offered_output_tokens_per_s", c->output_tps);
    json_num(j, "engine_prefill_tokens_per_s", c->engine_tps);
    json_num(j, "offered_work_engines", c->work);
    json_num(j, "utilisation_without_hits", c->work / o->engines);
    cJSON_AddBoolToObject(j, "overloaded", c->work > o->engines);
    json_num(j, "prefill_imbalance", prefill_imbalance(fr));
    arr = cJSON_AddArrayToObject(j, "per_engine");
    for (i = 0; i < fr->n; i++) {
        results *e = &fr->engine[i];
        cJSON *x = cJSON_CreateObject();
        summary s = ttft_summary(e->ttft, e->nttft);
        json_num(x, "engine", i);
        json_num(x, "requests", (double)e->requests);
        json_num(x, "prompt_blocks", (double)e->prompt_blocks);
        json_num(x, "hit_blocks", (double)e->hit_blocks);
        json_num(x, "hit_rate", ratio(e->hit_blocks, e->prompt_blocks));
        json_tier_hits(x, o, e);
        json_num(x, "ttft_p50_ms", s.p50);
        json_num(x, "ttft_p90_ms", s.p90);
        json_num(x, "ttft_p99_ms", s.p99);
        json_num(x, "prefill_tokens", (double)e->prefill_tokens);
        json_num(x, "busy_seconds", e->busy_seconds);
        json_num(x, "preemptions", (double)e->preempted);
        json_num(x, "queue_mean", e->queue_mean);
        json_num(x, "queue_max", e->queue_max);
        cJSON_AddItemToArray(arr, x);
    }
    arr = cJSON_AddObjectToObject(j, "queue_over_time");
    qt = cJSON_AddArrayToObject(arr, "t");
    ql = cJSON_AddArrayToObject(arr, "queue");
    for (q = 0; q < fr->nq; q++) {
        cJSON *row = cJSON_CreateArray();
        cJSON_AddItemToArray(qt, cJSON_CreateNumber(round(fr->qt[q] * 1e3) / 1e3));
        for (i = 0; i < fr->n; i++) cJSON_AddItemToArray(row, cJSON_CreateNumber(fr->qlen[q * fr->n + i]));
        cJSON_AddItemToArray(ql, row);
    }
}

void print_json(const workload *w, const options *o, results *r, const fleet_report *fr, const capacity *cap)
{
    cJSON *j = cJSON_CreateObject();
    char key[96], *text;
    int k, nk = o->remote ? TIER_ALL : TIER_KINDS;
    uint32_t bt = o->block_tokens;
    cJSON_AddStringToObject(j, "workload", w->is_trace ? "trace" : "synthetic");
    if (w->is_trace) cJSON_AddStringToObject(j, "trace", o->trace);
    else json_num(j, "seed", (double)o->seed);
    cJSON_AddStringToObject(j, "mode", o->sequential ? "sequential" : "scheduler");
    json_num(j, "block_tokens", bt);
    json_num(j, "device_blocks", o->device_blocks);
    json_num(j, "host_blocks", o->host_blocks);
    json_num(j, "disk_blocks", o->disk_blocks);
    if (o->remote) cJSON_AddStringToObject(j, "remote", o->remote);
    cJSON_AddStringToObject(j, "eviction", eviction_name(o->eviction));
    if (o->eviction == KVB_EVICT_FOL) json_num(j, "fol_step_end", (double)r->tr.device_step);
    if (o->eviction == KVB_EVICT_FOL) json_num(j, "fol_tails_first_end", (double)r->tr.device_tails);
    cJSON_AddStringToObject(j, "offload", offload_name(o->offload));
    cJSON_AddBoolToObject(j, "bytes", o->bytes);
    json_num(j, "requests", (double)r->requests);
    json_num(j, "skipped_requests", (double)r->skipped);
    json_num(j, "malformed_lines", (double)w->malformed);
    if (w->is_trace) json_num(j, "partial_last_blocks", (double)w->partial_last);
    json_num(j, "prompt_blocks", (double)r->prompt_blocks);
    json_num(j, "prompt_tokens", (double)r->prompt_blocks * bt);
    json_num(j, "hit_blocks", (double)r->hit_blocks);
    json_num(j, "hit_tokens", (double)r->hit_blocks * bt);
    json_num(j, "hit_rate", ratio(r->hit_blocks, r->prompt_blocks));
    for (k = 0; k < nk; k++) {
        snprintf(key, sizeof key, "%s_hit_blocks", tier_names[k]);
        json_num(j, key, (double)r->tier_hits[k]);
        snprintf(key, sizeof key, "%s_hit_tokens", tier_names[k]);
        json_num(j, key, (double)r->tier_hits[k] * bt);
        snprintf(key, sizeof key, "%s_hit_rate", tier_names[k]);
        json_num(j, key, ratio(r->tier_hits[k], r->prompt_blocks));
    }
    for (k = 0; k < nk; k++) {
        if (!r->tr.present[k]) continue;
        snprintf(key, sizeof key, "%s_evictions", tier_names[k]);
        json_num(j, key, (double)r->tr.evictions[k]);
    }
    for (k = 0; k < nk; k++) {
        if (r->tr.down_from[k] >= 0) {
            snprintf(key, sizeof key, "offloaded_blocks_%s_to_%s", tier_names[r->tr.down_from[k]], tier_names[k]);
            json_num(j, key, (double)r->tr.down_blocks[k]);
            snprintf(key, sizeof key, "offloaded_bytes_%s_to_%s", tier_names[r->tr.down_from[k]], tier_names[k]);
            json_num(j, key, (double)r->tr.down_bytes[k]);
        }
        if (k && r->tr.present[k]) {
            snprintf(key, sizeof key, "onboarded_blocks_%s_to_device", tier_names[k]);
            json_num(j, key, (double)r->tr.up_blocks[k]);
            snprintf(key, sizeof key, "onboarded_bytes_%s_to_device", tier_names[k]);
            json_num(j, key, (double)r->tr.up_bytes[k]);
        }
    }
    if (o->remote) {
        json_num(j, "remote_imported_blocks", (double)r->tr.redis.imported);
        json_num(j, "remote_checksum_errors", (double)r->tr.redis.checksum_errors);
        json_num(j, "remote_io_errors", (double)r->tr.redis.io_errors);
        json_num(j, "remote_misses", (double)r->tr.redis.misses);
        json_num(j, "remote_error_replies", (double)r->tr.redis.remote_errors);
        json_num(j, "remote_lookup_errors", (double)r->tr.redis.lookup_errors);
        json_num(j, "remote_disconnects", (double)r->tr.redis.disconnects);
        json_num(j, "remote_connect_failures", (double)r->tr.redis.connect_failures);
    }
    cJSON_AddBoolToObject(j, "bytes_modeled", !o->bytes);
    if (o->bytes) {
        json_num(j, "verified_blocks", (double)r->verified);
        json_num(j, "data_mismatches", (double)r->mismatches);
    }
    if (o->sequential) {
        json_num(j, "replay_seconds", r->replay_seconds);
        json_num(j, "timing_runs", (double)(r->timing_runs ? r->timing_runs : 1));
        json_num(j, "replay_ns_per_block", r->prompt_blocks ? r->replay_seconds * 1e9 / (double)r->prompt_blocks : 0);
        if (r->lru_checked) {
            json_num(j, "lru_reference_hit_rate", r->lru_rate);
            json_num(j, "lru_reference_ns_per_block",
                     r->prompt_blocks ? r->lru_seconds * 1e9 / (double)r->prompt_blocks : 0);
            json_num(j, "replay_vs_lru_reference", r->lru_seconds > 0 ? r->replay_seconds / r->lru_seconds : 0);
            cJSON_AddBoolToObject(j, "lru_match", fabs(ratio(r->hit_blocks, r->prompt_blocks) - r->lru_rate) <= 0.005);
        }
    } else {
        summary a = ttft_summary(r->ttft, r->nttft), b = ttft_summary(r->ttft_nocache, r->nttft_nocache);
        double mean = 0;
        size_t i;
        for (i = 0; i < r->ncpu; i++) mean += r->cpu[i];
        mean = r->ncpu ? mean / (double)r->ncpu : 0;
        json_num(j, "ttft_p50_ms", a.p50);
        json_num(j, "ttft_p90_ms", a.p90);
        json_num(j, "ttft_p99_ms", a.p99);
        json_num(j, "ttft_nocache_p50_ms", b.p50);
        json_num(j, "ttft_nocache_p90_ms", b.p90);
        json_num(j, "ttft_nocache_p99_ms", b.p99);
        json_num(j, "steps", (double)r->steps);
        json_num(j, "preemptions", (double)r->preempted);
        json_num(j, "cpu_us_per_step", mean * 1e6);
        json_num(j, "cpu_us_per_step_p99", percentile(r->cpu, r->ncpu, 99) * 1e6);
        json_num(j, "sim_seconds", r->sim_seconds);
        json_num(j, "wall_seconds", r->wall_seconds);
        json_num(j, "prefill_tokens", (double)r->prefill_tokens);
        if (fr) json_fleet(j, o, fr, cap);
        if (o->shards > 1) { /* every request's TTFT, so that the reports of the shards can be merged */
            cJSON *a = cJSON_AddArrayToObject(j, "ttft_ms");
            size_t i;
            for (i = 0; i < r->nttft; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber(round(r->ttft[i] * 1e6) / 1e3));
        }
    }
    text = cJSON_Print(j);
    if (!text) die(2, "out of memory");
    printf("%s\n", text);
    cJSON_free(text);
    cJSON_Delete(j);
}
