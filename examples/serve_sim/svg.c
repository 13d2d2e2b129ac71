/* svg.c — serve_sim's time series and the --svg chart (hit rate and tier occupancy over time) */
#include "sim.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* ---- time series for --svg ---------------------------------------------------------------------- */

void tiers_occupancy(const tiers *t, float *occ)
{
    uint32_t i;
    for (i = 0; i < TIER_ALL; i++) occ[i] = -1.0f;
    for (i = 0; i < t->n; i++) {
        kvb_pool_stats ps;
        memset(&ps, 0, sizeof ps);
        kvb_pool_get_stats(t->pool[i], &ps);
        if (!ps.num_blocks) continue;
        occ[t->kind[i]] = (float)(ps.num_blocks - ps.free_blocks) / (float)ps.num_blocks;
    }
}

uint32_t tiers_fol_step(const tiers *t)
{
    kvb_pool_stats ps;
    memset(&ps, 0, sizeof ps);
    if (t->n) kvb_pool_get_stats(t->pool[0], &ps);
    return ps.fol_class_step;
}

void series_add(series *sv, double x, const uint64_t *hits, uint64_t prompt, const float *occ, uint32_t step)
{
    sample *s;
    GROW(sv->s, sv->cap, sv->n + 1);
    s = &sv->s[sv->n++];
    memset(s, 0, sizeof *s);
    s->x = x;
    memcpy(s->hits, hits, sizeof s->hits);
    s->prompt = prompt;
    memcpy(s->occ, occ, sizeof s->occ);
    s->step = step;
}

/* ---- --svg -------------------------------------------------------------------------------------- */

static void svg_text_escaped(FILE *f, const char *s)
{
    for (; *s; s++) {
        if (*s == '<') fputs("&lt;", f);
        else if (*s == '>') fputs("&gt;", f);
        else if (*s == '&') fputs("&amp;", f);
        else fputc(*s, f);
    }
}

/* Tick spacing: 1, 2 or 5 times a power of ten, about range / 6. */
static double nice_step(double range)
{
    double raw = range / 6.0, p = pow(10.0, floor(log10(raw))), f = raw / p;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * p;
}

/* The last sample at or before each of nb equal intervals of x (NULL when the interval has none). */
static const sample *bucket_end(const series *sv, size_t *i, size_t b, size_t nb, double x0, double x1)
{
    double edge = x0 + (x1 - x0) * (double)(b + 1) / (double)nb;
    const sample *last = NULL;
    while (*i < sv->n && (sv->s[*i].x <= edge || b + 1 == nb)) last = &sv->s[(*i)++];
    return last;
}

/* ---- the fleet's panels (--engines N > 1), below the two above ---------------------------------- */

static const char *engine_color(uint32_t i)
{
    static const char *c[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                              "#bcbd22", "#17becf"};
    return c[i % (sizeof c / sizeof c[0])];
}

/* Queue length of every engine over time (its own scale), then each engine's hit rate by tier as
 * stacked bars with its share of the fleet's prefill work written above. */
static void svg_fleet(FILE *f, const fleet_report *fr, double x0, double x1, int W, int L, int R, double top)
{
    const char *tier_color[TIER_KINDS + 1] = {"#2ca02c", "#9467bd", "#8c564b", "#17becf"};
    double bot = top + 200, qmax = 1, btop = bot + 80, bbot = btop + 200, total = 0, bw;
    size_t q;
    uint32_t i;
    int k;
    for (q = 0; q < fr->nq * fr->n; q++)
        if (fr->qlen[q] > qmax) qmax = fr->qlen[q];
    for (i = 0; i < fr->n; i++) total += (double)fr->engine[i].prefill_tokens;
    fprintf(f, "<text x=\"%d\" y=\"%.0f\" font-weight=\"bold\">queue length per engine (requests waiting for "
               "admission)</text>\n", L, top - 10);
    fprintf(f, "<rect x=\"%d\" y=\"%.0f\" width=\"%d\" height=\"200\" fill=\"none\" stroke=\"#444\"/>\n", L, top, W - L - R);
    for (k = 0; k <= 4; k++)
        fprintf(f, "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%.0f</text>\n", L - 6, bot - 50.0 * k + 4, qmax * k / 4);
    for (i = 0; i < fr->n && fr->nq; i++) {
        fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.2\" points=\"", engine_color(i));
        for (q = 0; q < fr->nq; q++)
            fprintf(f, "%s%.1f,%.1f", q ? " " : "", L + (double)(W - L - R) * (fr->qt[q] - x0) / (x1 - x0),
                    bot - 200.0 * fr->qlen[q * fr->n + i] / qmax);
        fprintf(f, "\"/>\n");
    }
    fprintf(f, "<text x=\"%d\" y=\"%.0f\" font-weight=\"bold\">hit rate by tier per engine; above each, its share "
               "of the fleet's prefill work</text>\n", L, btop - 24);
    fprintf(f, "<rect x=\"%d\" y=\"%.0f\" width=\"%d\" height=\"200\" fill=\"none\" stroke=\"#444\"/>\n", L, btop, W - L - R);
    bw = (double)(W - L - R) / fr->n;
    for (i = 0; i < fr->n; i++) {
        const results *e = &fr->engine[i];
        double y = bbot, x = L + bw * i + bw * 0.15;
        for (k = 0; k < TIER_ALL; k++) {
            double h = 200.0 * ratio(e->tier_hits[k], e->prompt_blocks);
            if (h <= 0) continue;
            y -= h;
            fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"%s\"/>\n", x, y, bw * 0.7, h,
                    tier_color[k]);
        }
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%.3f, %.0f%%</text>\n", x + bw * 0.35, y - 4,
                ratio(e->hit_blocks, e->prompt_blocks), total > 0 ? 100.0 * (double)e->prefill_tokens / total : 0);
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" fill=\"%s\">engine %u</text>\n", x + bw * 0.35,
                bbot + 16, engine_color(i), i);
    }
}

int write_svg(const char *path, const series *sv, const fleet_report *fr, const char *title, const char *xlabel)
{
    enum { W = 960, H = 690, L = 80, R = 40, B = 120 };
    int fleet = fr && fr->n > 1, height = fleet ? H + 560 : H;
    const double top0 = 70, bot0 = 300, top1 = 370, bot1 = 580;
    const char *tier_color[TIER_KINDS] = {"#2ca02c", "#9467bd", "#8c564b"};
    const sample *first, *last;
    FILE *f;
    double x0, x1, step, v;
    size_t b, i, nb;
    int k;
    if (!sv->n) return 0;
    if (!(f = fopen(path, "w"))) return -1;
    first = &sv->s[0];
    last = &sv->s[sv->n - 1];
    x0 = first->x;
    x1 = last->x > x0 ? last->x : x0 + 1;
    nb = sv->n < B ? sv->n : B;
    step = nice_step(x1 - x0);
    fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
               "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
            W, height, W, height);
    fprintf(f, "<text x=\"%d\" y=\"28\" font-size=\"16\" font-weight=\"bold\">", L);
    svg_text_escaped(f, title);
    fprintf(f, "</text>\n");
#define SX(x) (L + (double)(W - L - R) * ((x) - x0) / (x1 - x0))
#define SY(v, top, bot) ((bot) - ((bot) - (top)) * (v))
    for (k = 0; k < 2; k++) { /* the two panels: title, grid, axes */
        double top = k ? top1 : top0, bot = k ? bot1 : bot0;
        int g;
        fprintf(f, "<text x=\"%d\" y=\"%.0f\" font-weight=\"bold\">%s</text>\n", L, top - 10,
                k ? "tier occupancy (cached blocks / capacity)"
                  : "prefix-cache hit rate (hit blocks / prompt blocks)");
        for (g = 0; g <= 4; g++) {
            double y = bot - (bot - top) * g / 4.0;
            fprintf(f, "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                       "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%.2f</text>\n",
                    L, y, W - R, y, L - 6, y + 4, g / 4.0);
        }
        for (v = ceil(x0 / step) * step; v <= x1 + 1e-9 * step; v += step)
            fprintf(f, "<line x1=\"%.1f\" y1=\"%.0f\" x2=\"%.1f\" y2=\"%.0f\" stroke=\"#eee\"/>"
                       "<text x=\"%.1f\" y=\"%.0f\" text-anchor=\"middle\">%g</text>\n",
                    SX(v), top, SX(v), bot, SX(v), bot + 16, v);
        fprintf(f, "<rect x=\"%d\" y=\"%.0f\" width=\"%d\" height=\"%.0f\" fill=\"none\" stroke=\"#444\"/>\n", L, top,
                W - L - R, bot - top);
        fprintf(f, "<text x=\"%d\" y=\"%.0f\" text-anchor=\"middle\">%s</text>\n", (W + L - R) / 2, bot + 34, xlabel);
    }
    /* hit rate per interval (all tiers, G4 included, then host and disk alone) and cumulative */
    for (k = 0; k < 2 + TIER_KINDS - 1; k++) {
        static const char *style[] = {"stroke=\"#1f77b4\" stroke-width=\"1.5\"", "stroke=\"#ff7f0e\" stroke-width=\"2\"",
                                      "stroke=\"#9467bd\" stroke-width=\"1.5\" stroke-dasharray=\"4 3\"",
                                      "stroke=\"#8c564b\" stroke-width=\"1.5\" stroke-dasharray=\"4 3\""};
        uint64_t ph = 0, pp = 0;
        int open = 0;
        if (k >= 2 && first->occ[k - 1] < 0) continue; /* no such tier */
        for (i = 0, b = 0; b < nb; b++) {
            const sample *e = bucket_end(sv, &i, b, nb, x0, x1);
            uint64_t h;
            if (!e) continue;
            h = k >= 2 ? e->hits[k - 1] : e->hits[0] + e->hits[1] + e->hits[2] + e->hits[TIER_REMOTE]; /* G4 too */
            if (k == 1 ? e->prompt > 0 : e->prompt > pp) {
                v = k == 1 ? (double)h / (double)e->prompt : (double)(h - ph) / (double)(e->prompt - pp);
                fprintf(f, "%s%.1f,%.1f", open ? " " : "<polyline fill=\"none\" points=\"", SX(e->x), SY(v, top0, bot0));
                open = 1;
            }
            ph = h;
            pp = e->prompt;
        }
        if (open) fprintf(f, "\" %s/>\n", style[k]);
    }
    for (k = 0; k < TIER_KINDS; k++) { /* occupancy per tier */
        int open = 0;
        if (first->occ[k] < 0) continue;
        for (i = 0, b = 0; b < nb; b++) {
            const sample *e = bucket_end(sv, &i, b, nb, x0, x1);
            if (!e) continue;
            fprintf(f, "%s%.1f,%.1f", open ? " " : "<polyline fill=\"none\" stroke-width=\"2\" points=\"", SX(e->x),
                    SY(e->occ[k], top1, bot1));
            open = 1;
        }
        if (open) fprintf(f, "\" stroke=\"%s\"/>\n", tier_color[k]);
    }
    { /* FOL's class step over time (self-tuning), scaled to its largest value, in the occupancy panel */
        uint32_t most = 0;
        int open = 0;
        for (i = 0; i < sv->n; i++)
            if (sv->s[i].step > most) most = sv->s[i].step;
        for (i = 0, b = 0; most && b < nb; b++) {
            const sample *e = bucket_end(sv, &i, b, nb, x0, x1);
            if (!e) continue;
            fprintf(f, "%s%.1f,%.1f", open ? " " : "<polyline fill=\"none\" stroke=\"#d62728\" stroke-dasharray=\"2 2\" points=\"",
                    SX(e->x), SY((double)e->step / most, top1, bot1));
            open = 1;
        }
        if (open)
            fprintf(f, "\"/>\n<text x=\"%d\" y=\"%.0f\" text-anchor=\"end\" fill=\"#d62728\">FOL class step "
                       "(dashed; top = %u block references)</text>\n", W - R, top1 - 10, most);
    }
#undef SX
#undef SY
    { /* legend */
        static const char *names[] = {"hit rate per interval", "cumulative hit rate", "from host", "from disk"};
        static const char *colors[] = {"#1f77b4", "#ff7f0e", "#9467bd", "#8c564b"};
        double y = H - 44;
        int x = L;
        for (k = 0; k < 4; k++) {
            if (k >= 2 && first->occ[k - 1] < 0) continue;
            fprintf(f, "<line x1=\"%d\" y1=\"%.0f\" x2=\"%d\" y2=\"%.0f\" stroke=\"%s\" stroke-width=\"2\"%s/>"
                       "<text x=\"%d\" y=\"%.0f\">%s</text>\n",
                    x, y, x + 24, y, colors[k], k >= 2 ? " stroke-dasharray=\"4 3\"" : "", x + 30, y + 4, names[k]);
            x += k < 2 ? 165 : 95;
        }
        x = L;
        y = H - 20;
        for (k = 0; k < TIER_KINDS; k++) {
            if (first->occ[k] < 0) continue;
            fprintf(f, "<line x1=\"%d\" y1=\"%.0f\" x2=\"%d\" y2=\"%.0f\" stroke=\"%s\" stroke-width=\"4\"/>"
                       "<text x=\"%d\" y=\"%.0f\">%s occupancy</text>\n", x, y, x + 24, y, tier_color[k], x + 30, y + 4,
                    tier_names[k]);
            x += 165;
        }
    }
    if (fleet) svg_fleet(f, fr, x0, x1, W, L, R, H + 40);
    fprintf(f, "</svg>\n");
    return fclose(f) == 0 ? 0 : -1;
}
