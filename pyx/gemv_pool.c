/* gemv_pool.c: the CPU lane's pinned worker pool and its job queue (see gemv.h).
 *
 * Worker 0 takes the next job off the queue, plans it, and publishes it by bumping `job_gen`;
 * every worker then runs the job's phases (gemv_exec.h) with a barrier after each. Worker 0
 * finally writes the status, then the job's `finished` flag and its `done` word. Idle workers
 * spin for the pool's idle spin (SPIN_NS unless gemv_pool_set_idle_spin changed it: a decode
 * step's MoE layers come back to back) and then sleep on a futex, so an idle lane costs no CPU.
 *
 * A batch (gemv_pool_run_batch) is a run of independent jobs queued together; the calling thread
 * may take its own batch's jobs off the head of the queue and run them alone, with an exec of
 * its own planned for the pool's thread count (so the output does not depend on who ran a job). */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "gemv_exec.h"

#define SPIN_NS 200000L      /* idle spin before sleeping: covers the gap between MoE layers */
#define BARRIER_SPIN_NS 50000L /* then yield: a descheduled worker must get its core back */
/* A caller waiting for a job spins only briefly: it is not one of the workers, and where the
 * workers hold every core its spin takes a worker's core, which every barrier then waits for
 * (16 workers on 16 H200-host cores: 0.83 of the throughput of 16 independent lanes with the
 * 200 us spin). Jobs worth waiting for take milliseconds; a futex wake costs tens of us. */
#define CALLER_SPIN_NS 20000L
#define MAX_QUEUED 256

struct gemv_pool {
    int num_threads;
    pthread_t *threads;
    gemv_exec exec;
    int plan_status;
    gemv_job *current;
    pthread_mutex_t lock; /* guards head, tail, queued */
    gemv_job *head, *tail;
    int queued;
    _Atomic uint32_t queue_word; /* bumped on every submit and on stop */
    _Atomic uint32_t job_gen;    /* bumped by worker 0 when `current` changes */
    _Atomic int stop;
    _Atomic uint32_t bar_count, bar_gen;
    _Atomic long idle_spin_ns; /* how long an idle worker spins before it sleeps */
    pthread_mutex_t caller_lock; /* guards caller_exec: one helping caller at a time */
    gemv_exec caller_exec;
};

typedef struct {
    gemv_pool *pool;
    int tid;
} worker_arg;

static void futex_wait(_Atomic uint32_t *word, uint32_t seen)
{
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *word)
{
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, 0x7fffffff, NULL, NULL, 0);
}

static void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* Wait until *word != seen: spin for spin_ns, then sleep. */
static void wait_change(_Atomic uint32_t *word, uint32_t seen, long spin_ns)
{
    long start = now_ns();
    for (int i = 0; atomic_load_explicit(word, memory_order_acquire) == seen; i++) {
        if ((i & 63) == 63 && now_ns() - start > spin_ns)
            futex_wait(word, seen);
        else
            cpu_relax();
    }
}

static void barrier(gemv_pool *pool)
{
    uint32_t gen = atomic_load_explicit(&pool->bar_gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&pool->bar_count, 1, memory_order_acq_rel) ==
        (uint32_t)pool->num_threads - 1) {
        atomic_store_explicit(&pool->bar_count, 0, memory_order_relaxed);
        atomic_store_explicit(&pool->bar_gen, gen + 1, memory_order_release);
        return;
    }
    long start = now_ns();
    for (int i = 0; atomic_load_explicit(&pool->bar_gen, memory_order_acquire) == gen; i++) {
        if ((i & 63) == 63 && now_ns() - start > BARRIER_SPIN_NS)
            sched_yield();
        else
            cpu_relax();
    }
}

static long idle_spin(gemv_pool *pool)
{
    return atomic_load_explicit(&pool->idle_spin_ns, memory_order_relaxed);
}

/* Appends job to the queue; pool->lock must be held. */
static void enqueue_locked(gemv_pool *pool, gemv_job *job)
{
    if (pool->tail)
        pool->tail->next = job;
    else
        pool->head = job;
    pool->tail = job;
    pool->queued++;
}

/* Worker 0: the next queued job, or NULL once stopped and drained. */
static gemv_job *next_job(gemv_pool *pool)
{
    for (;;) {
        uint32_t seen = atomic_load_explicit(&pool->queue_word, memory_order_acquire);
        pthread_mutex_lock(&pool->lock);
        gemv_job *job = pool->head;
        if (job) {
            pool->head = job->next;
            if (!pool->head)
                pool->tail = NULL;
            pool->queued--;
        }
        pthread_mutex_unlock(&pool->lock);
        if (job)
            return job;
        if (atomic_load_explicit(&pool->stop, memory_order_acquire))
            return NULL;
        wait_change(&pool->queue_word, seen, idle_spin(pool));
    }
}

static void finish_job(gemv_job *job, int status)
{
    job->status = status;
    if (job->done)
        __atomic_store_n(job->done, job->seq, __ATOMIC_RELEASE);
    /* After `finished` the caller may free the job; the wake only uses its address. */
    __atomic_store_n(&job->finished, 1, __ATOMIC_RELEASE);
    futex_wake((_Atomic uint32_t *)&job->finished);
}

static void *worker_main(void *arg)
{
    worker_arg *wa = arg;
    gemv_pool *pool = wa->pool;
    int tid = wa->tid;
    free(wa);
    uint32_t seen_gen = 0;
    for (;;) {
        gemv_job *job;
        if (tid == 0) {
            job = next_job(pool);
            if (job)
                pool->plan_status = gemv_exec_plan(&pool->exec, job, pool->num_threads);
            pool->current = job;
            seen_gen = atomic_load_explicit(&pool->job_gen, memory_order_relaxed) + 1;
            atomic_store_explicit(&pool->job_gen, seen_gen, memory_order_release);
            futex_wake(&pool->job_gen);
        } else {
            wait_change(&pool->job_gen, seen_gen, idle_spin(pool));
            seen_gen = atomic_load_explicit(&pool->job_gen, memory_order_acquire);
            job = pool->current;
        }
        if (!job)
            return NULL;
        /* Every worker passes at least one barrier per job, so worker 0 cannot publish the
         * next job before all of them have read this one. */
        if (pool->plan_status == GEMV_OK) {
            for (int phase = 0; phase < GEMV_NUM_PHASES; phase++) {
                gemv_exec_phase(&pool->exec, phase);
                barrier(pool);
            }
        } else {
            barrier(pool);
        }
        if (tid == 0)
            finish_job(job, pool->plan_status);
    }
}

gemv_pool *gemv_pool_create(const int *cpus, int num_threads, char *msg, size_t msg_len)
{
    if (num_threads < 1 || num_threads > 1024) {
        snprintf(msg, msg_len, "num_threads %d must be 1..1024", num_threads);
        return NULL;
    }
    gemv_pool *pool = calloc(1, sizeof *pool);
    pthread_t *threads = calloc((size_t)num_threads, sizeof *threads);
    if (!pool || !threads) {
        free(pool);
        free(threads);
        snprintf(msg, msg_len, "out of memory creating a pool of %d threads", num_threads);
        return NULL;
    }
    pool->num_threads = num_threads;
    pool->threads = threads;
    atomic_init(&pool->idle_spin_ns, SPIN_NS);
    pthread_mutex_init(&pool->lock, NULL);
    pthread_mutex_init(&pool->caller_lock, NULL);
    for (int i = 0; i < num_threads; i++) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        if (cpus) {
            cpu_set_t set;
            CPU_ZERO(&set);
            if (cpus[i] < 0 || cpus[i] >= CPU_SETSIZE) {
                snprintf(msg, msg_len, "cpu %d is not a valid CPU number", cpus[i]);
                pthread_attr_destroy(&attr);
                num_threads = i;
                goto fail;
            }
            CPU_SET(cpus[i], &set);
            pthread_attr_setaffinity_np(&attr, sizeof set, &set);
        }
        worker_arg *wa = malloc(sizeof *wa);
        int rc = wa ? 0 : ENOMEM;
        if (wa) {
            wa->pool = pool;
            wa->tid = i;
            rc = pthread_create(&threads[i], &attr, worker_main, wa);
            if (rc)
                free(wa);
        }
        pthread_attr_destroy(&attr);
        if (rc) {
            if (cpus)
                snprintf(msg, msg_len,
                         "cannot start CPU lane thread %d pinned to cpu %d (%s); is the cpu in "
                         "this process's affinity mask?",
                         i, cpus[i], strerror(rc));
            else
                snprintf(msg, msg_len, "cannot start CPU lane thread %d (%s)", i, strerror(rc));
            num_threads = i;
            goto fail;
        }
    }
    return pool;
fail:
    /* Threads already started wait for worker 0 (or are worker 0); stop and join them. */
    pool->num_threads = num_threads;
    if (num_threads == 0) {
        pthread_mutex_destroy(&pool->lock);
        pthread_mutex_destroy(&pool->caller_lock);
        free(threads);
        free(pool);
        return NULL;
    }
    gemv_pool_destroy(pool);
    return NULL;
}

void gemv_pool_destroy(gemv_pool *pool)
{
    if (!pool)
        return;
    atomic_store_explicit(&pool->stop, 1, memory_order_release);
    atomic_fetch_add_explicit(&pool->queue_word, 1, memory_order_acq_rel);
    futex_wake(&pool->queue_word);
    for (int i = 0; i < pool->num_threads; i++)
        pthread_join(pool->threads[i], NULL);
    pthread_mutex_destroy(&pool->lock);
    pthread_mutex_destroy(&pool->caller_lock);
    gemv_exec_free(&pool->exec);
    gemv_exec_free(&pool->caller_exec);
    free(pool->threads);
    free(pool);
}

int gemv_pool_threads(const gemv_pool *pool) { return pool->num_threads; }

int gemv_pool_set_idle_spin(gemv_pool *pool, long ns)
{
    if (ns < 0)
        return GEMV_EINVAL;
    atomic_store_explicit(&pool->idle_spin_ns, ns, memory_order_relaxed);
    return GEMV_OK;
}

long gemv_pool_idle_spin(gemv_pool *pool) { return idle_spin(pool); }

int gemv_pool_submit(gemv_pool *pool, gemv_job *job, char *msg, size_t msg_len)
{
    int rc = gemv_job_check(job, msg, msg_len);
    if (rc)
        return rc;
    job->status = GEMV_EPENDING;
    job->next = NULL;
    __atomic_store_n(&job->finished, 0, __ATOMIC_RELAXED);
    pthread_mutex_lock(&pool->lock);
    if (pool->queued >= MAX_QUEUED || atomic_load(&pool->stop)) {
        pthread_mutex_unlock(&pool->lock);
        snprintf(msg, msg_len, "the CPU lane's queue is full (%d jobs) or the pool is stopping",
                 MAX_QUEUED);
        return GEMV_EBUSY;
    }
    enqueue_locked(pool, job);
    pthread_mutex_unlock(&pool->lock);
    atomic_fetch_add_explicit(&pool->queue_word, 1, memory_order_acq_rel);
    futex_wake(&pool->queue_word);
    return GEMV_OK;
}

int gemv_pool_wait(gemv_pool *pool, gemv_job *job)
{
    (void)pool;
    wait_change((_Atomic uint32_t *)&job->finished, 0, CALLER_SPIN_NS);
    return job->status;
}

/* The calling thread runs one job alone with the pool's caller exec (caller_lock held). */
static void run_on_caller(gemv_pool *pool, gemv_job *job)
{
    gemv_exec *ex = &pool->caller_exec;
    int rc = gemv_exec_plan(ex, job, pool->num_threads);
    if (rc == GEMV_OK)
        for (int phase = 0; phase < GEMV_NUM_PHASES; phase++)
            gemv_exec_phase(ex, phase);
    job->status = rc;
    if (job->done)
        __atomic_store_n(job->done, job->seq, __ATOMIC_RELEASE);
    __atomic_store_n(&job->finished, 1, __ATOMIC_RELEASE);
}

static int in_batch(const gemv_job *job, const gemv_job *jobs, int num_jobs)
{
    uintptr_t p = (uintptr_t)job, lo = (uintptr_t)jobs, hi = (uintptr_t)(jobs + num_jobs);
    return job && p >= lo && p < hi;
}

int gemv_pool_run_batch(gemv_pool *pool, gemv_job *jobs, int num_jobs, int caller, char *msg,
                        size_t msg_len)
{
    if (num_jobs < 0 || (num_jobs && !jobs) || caller < GEMV_CALLER_WAITS ||
        caller > GEMV_CALLER_RUNS_ALL) {
        snprintf(msg, msg_len, "a batch needs num_jobs >= 0 (got %d), jobs, and caller 0..2 (got %d)",
                 num_jobs, caller);
        return GEMV_EINVAL;
    }
    for (int i = 0; i < num_jobs; i++) {
        int rc = gemv_job_check(&jobs[i], msg, msg_len);
        if (rc) {
            char inner[GEMV_MSG_BYTES];
            snprintf(inner, sizeof inner, "%s", msg);
            snprintf(msg, msg_len, "batch job %d: %s", i, inner);
            return rc;
        }
        jobs[i].status = GEMV_EPENDING;
        jobs[i].next = NULL;
        __atomic_store_n(&jobs[i].finished, 0, __ATOMIC_RELAXED);
    }
    if (caller != GEMV_CALLER_WAITS)
        pthread_mutex_lock(&pool->caller_lock);
    if (caller == GEMV_CALLER_RUNS_ALL) {
        for (int i = 0; i < num_jobs; i++)
            run_on_caller(pool, &jobs[i]);
    } else {
        int queued = 0;
        for (;;) {
            int added = 0;
            gemv_job *mine = NULL;
            pthread_mutex_lock(&pool->lock);
            if (atomic_load(&pool->stop)) {
                pthread_mutex_unlock(&pool->lock);
                break; /* the jobs left unqueued are failed below */
            }
            while (queued < num_jobs && pool->queued < MAX_QUEUED) {
                enqueue_locked(pool, &jobs[queued++]);
                added++;
            }
            if (caller == GEMV_CALLER_HELPS && in_batch(pool->head, jobs, num_jobs)) {
                mine = pool->head;
                pool->head = mine->next;
                if (!pool->head)
                    pool->tail = NULL;
                pool->queued--;
            }
            pthread_mutex_unlock(&pool->lock);
            if (added) {
                atomic_fetch_add_explicit(&pool->queue_word, 1, memory_order_acq_rel);
                futex_wake(&pool->queue_word);
            }
            if (mine)
                run_on_caller(pool, mine);
            else if (queued == num_jobs)
                break;
            else
                sched_yield(); /* the queue is full of other callers' jobs */
        }
        for (int i = queued; i < num_jobs; i++) { /* only when the pool stopped */
            jobs[i].status = GEMV_EBUSY;
            __atomic_store_n(&jobs[i].finished, 1, __ATOMIC_RELEASE);
        }
    }
    if (caller != GEMV_CALLER_WAITS)
        pthread_mutex_unlock(&pool->caller_lock);
    int status = GEMV_OK;
    for (int i = 0; i < num_jobs; i++) {
        wait_change((_Atomic uint32_t *)&jobs[i].finished, 0, CALLER_SPIN_NS);
        if (status == GEMV_OK && jobs[i].status != GEMV_OK) {
            status = jobs[i].status;
            snprintf(msg, msg_len, "batch job %d failed while running (status %d)", i, status);
        }
    }
    return status;
}
