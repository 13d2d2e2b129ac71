/* util.c — serve_sim's small utilities: allocation, errors, clocks, percentiles, a map, clean-up on signals */
#include "sim.h"

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---- small utilities ---------------------------------------------------------------------------- */

void die(int status, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "serve_sim: ");
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(status);
}

void *xrealloc(void *p, size_t n)
{
    void *q = realloc(p, n ? n : 1);
    if (!q) die(2, "out of memory (%zu bytes)", n);
    return q;
}

void *xcalloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) die(2, "out of memory");
    return p;
}

void *grow_to(void *p, size_t *cap, size_t need, size_t size)
{
    size_t c = *cap ? *cap : 16;
    if (need <= *cap) return p;
    while (c < need) c *= 2;
    *cap = c;
    return xrealloc(p, c * size);
}

void check_kv(int r, const char *what)
{
    if (r != 0) die(2, "%s: %s", what, kvs_result_string(r));
}

double wall_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

double cpu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double percentile(double *v, size_t n, double q)
{
    size_t k;
    if (!n) return NAN;
    qsort(v, n, sizeof *v, cmp_double);
    k = (size_t)ceil(q / 100.0 * (double)n);
    return v[k ? k - 1 : 0];
}

void map_init(u64map *m, size_t expect)
{
    size_t cap = 16, i;
    while (cap < expect * 2) cap *= 2;
    m->key = (uint64_t *)xcalloc(cap, sizeof *m->key);
    m->val = (uint32_t *)xcalloc(cap, sizeof *m->val);
    for (i = 0; i < cap; i++) m->val[i] = UINT32_MAX;
    m->mask = cap - 1;
    m->n = 0;
}
void map_free(u64map *m)
{
    free(m->key);
    free(m->val);
    memset(m, 0, sizeof *m);
}
static size_t map_slot(const u64map *m, uint64_t k)
{
    size_t i = (size_t)mix64(k) & m->mask;
    while (m->val[i] != UINT32_MAX && m->key[i] != k) i = (i + 1) & m->mask;
    return i;
}
uint32_t map_get(const u64map *m, uint64_t k) { return m->val[map_slot(m, k)]; }
void map_put(u64map *m, uint64_t k, uint32_t v)
{
    size_t i;
    if ((m->n + 1) * 2 > m->mask + 1) { /* grow */
        u64map g;
        size_t j;
        map_init(&g, m->mask + 1);
        for (j = 0; j <= m->mask; j++)
            if (m->val[j] != UINT32_MAX) map_put(&g, m->key[j], m->val[j]);
        map_free(m);
        *m = g;
    }
    i = map_slot(m, k);
    if (m->val[i] == UINT32_MAX) m->n++;
    m->key[i] = k;
    m->val[i] = v;
}
void map_del(u64map *m, uint64_t k)
{
    size_t i = map_slot(m, k), j;
    if (m->val[i] == UINT32_MAX) return;
    m->val[i] = UINT32_MAX;
    m->n--;
    for (j = (i + 1) & m->mask; m->val[j] != UINT32_MAX; j = (j + 1) & m->mask) {
        size_t home = (size_t)mix64(m->key[j]) & m->mask;
        /* move j back to i when its home is not within (i, j] cyclically */
        if (((j - home) & m->mask) >= ((j - i) & m->mask)) {
            m->key[i] = m->key[j];
            m->val[i] = m->val[j];
            m->val[j] = UINT32_MAX;
            i = j;
        }
    }
}

char tmp_paths[MAX_ENGINES][64];
char console_path[108];
void remove_tmp(uint32_t engine)
{
    if (tmp_paths[engine][0]) unlink(tmp_paths[engine]);
    tmp_paths[engine][0] = 0;
}
void remove_tmp_all(void)
{
    uint32_t i;
    for (i = 0; i < MAX_ENGINES; i++) remove_tmp(i);
}
void on_signal(int sig)
{
    uint32_t i;
    for (i = 0; i < MAX_ENGINES; i++)
        if (tmp_paths[i][0]) unlink(tmp_paths[i]);
    if (console_path[0]) unlink(console_path);
    signal(sig, SIG_DFL);
    raise(sig);
}
