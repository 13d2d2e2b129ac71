/* fuzz_backend.h — the fuzz targets' copy backend: the memcpy backend (inline) under faults the input
 * chooses. Include after kvoffload.h. */
#ifndef KVT_FUZZ_BACKEND_H
#define KVT_FUZZ_BACKEND_H
#include <stdlib.h>
#include <string.h>

/* A backend the input steers: copies through the memcpy backend, but it may hold jobs (the pipeline sees
 * them in flight until a later op lets them go) and fail the copies whose place in the job the fail bits
 * name. Failed copies and jobs that finish late are what join, retry and cancel paths need. */
#define FZ_HELD 8
#define FZ_RUNS 32 /* inline copies in progress at once (a done may submit the next job) */
typedef struct fz_copy { kvo_copy_job *job; uint8_t fail_bits; } fz_copy;
typedef struct fz_faulty {
    kvo_backend base;
    kvo_backend *inner;      /* memcpy, inline: a job is done when submit returns */
    int hold, refuse;        /* refuse: submit fails (the pipeline gets the error, done is not called) */
    uint8_t fail_bits;       /* copy i of a job fails when bit i % 8 is set */
    kvo_copy_job *held[FZ_HELD];
    size_t n_held;
    fz_copy run[FZ_RUNS];
} fz_faulty;

static inline int fz_faulty_submit(kvo_backend *self, kvo_copy_job *job);

/* Over inner (a memcpy backend with no threads), no faults yet. */
static inline void fz_faulty_init(fz_faulty *b, kvo_backend *inner)
{
    memset(b, 0, sizeof *b);
    b->inner = inner;
    b->base.submit = fz_faulty_submit;
    b->base.name = "fuzz";
    b->base.impl = b;
}

/* The inner copy finished: copies the fail bits name become I/O errors, then the pipeline hears of it. */
static inline void fz_faulty_done(kvo_copy_job *shadow, int result, const char *message)
{
    fz_copy *run = (fz_copy *)shadow->user;
    kvo_copy_job *job = run->job;
    int failed = 0;
    for (size_t i = 0; i < job->n; i++)
        if ((run->fail_bits >> (i % 8)) & 1u) job->results[i] = KVO_EIO, failed = 1;
    job->bytes = shadow->bytes;
    run->job = NULL;
    job->done(job, failed && result == KVO_OK ? KVO_EIO : result, failed && !message ? "fuzz: copy failed" : message);
}

/* Runs a job through the inner backend with the faults chosen now. */
static inline int fz_faulty_run(fz_faulty *b, kvo_copy_job *job)
{
    kvo_copy_job shadow = *job;
    fz_copy *run = NULL;
    for (size_t k = 0; k < FZ_RUNS && !run; k++)
        if (!b->run[k].job) run = &b->run[k];
    if (!run || b->refuse) return KVO_EIO;
    run->job = job;
    run->fail_bits = b->fail_bits;
    shadow.done = fz_faulty_done;
    shadow.user = run;
    int r = b->inner->submit(b->inner, &shadow);
    if (r != KVO_OK) run->job = NULL;
    return r;
}

static inline int fz_faulty_submit(kvo_backend *self, kvo_copy_job *job)
{
    fz_faulty *b = (fz_faulty *)self->impl;
    if (kvo_copy_job_check(job) != KVO_OK) return KVO_EINVAL;
    if (b->hold && !b->refuse && b->n_held < FZ_HELD) {
        b->held[b->n_held++] = job;
        return KVO_OK;
    }
    return fz_faulty_run(b, job);
}

/* Held jobs run now, oldest first (with the fail bits of now). */
static inline void fz_faulty_release(fz_faulty *b)
{
    size_t n = b->n_held;
    kvo_copy_job *jobs[FZ_HELD];
    memcpy(jobs, b->held, n * sizeof *jobs);
    b->n_held = 0; /* a done that submits again finds the list empty */
    for (size_t i = 0; i < n; i++) /* accepted once: done must come, so a refusal now is a failed copy */
        if (fz_faulty_run(b, jobs[i]) != KVO_OK) {
            for (size_t j = 0; j < jobs[i]->n; j++) jobs[i]->results[j] = KVO_EIO;
            jobs[i]->done(jobs[i], KVO_EIO, "fuzz: held job failed");
        }
}
#endif
