// Device-side CLOCK expert cache for exact mode: route (bookkeeping + table rewrite)
// and copy (home record -> VRAM slot). Both run on the caller's stream between
// exllamav3's router and its MoE kernel, so no host sync is needed per layer.
#include <cstddef>

#include <cuda_runtime.h>

#include "glm53_cuda.h"

namespace {

__device__ void point_tables(g53_ec *ec, int key, int64_t base)
{
    int layer = key / ec->n_experts;
    int expert = key % ec->n_experts;
    for (int p = 0; p < 3; p++) {
        int64_t *table = reinterpret_cast<int64_t *>(ec->tables[3 * layer + p]);
        table[expert] = base + ec->part_off[p];
    }
}

// Where a key's table entries belong when nothing is staged: its slot, else its home.
__device__ int64_t resident_base(const g53_ec *ec, int key)
{
    int s = ec->key_slot[key];
    return s >= 0 ? (int64_t)(ec->slot_base + (int64_t)s * ec->slot_bytes) : ec->home[key];
}

// Grid-stride copy of n_jobs records of `bytes` (a multiple of 16) each.
__device__ void copy_records(const int64_t *job_src, const int64_t *job_dst, int n_jobs, int64_t bytes)
{
    int64_t vec_per_job = bytes / 16;
    int64_t total = vec_per_job * n_jobs;
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        int64_t job = i / vec_per_job;
        int64_t off = i - job * vec_per_job;
        const int4 *src = reinterpret_cast<const int4 *>(job_src[job]);
        int4 *dst = reinterpret_cast<int4 *>(job_dst[job]);
        dst[off] = __ldcs(src + off);
    }
}

// One warp. Dedup and lookups run across lanes; admissions run in pick order, each
// victim search scanning 32 slots per step with a ballot (same victims as a serial CLOCK).
__global__ void route_kernel(g53_ec *ec, const int64_t *sel, int n_sel, int layer, int admit)
{
    __shared__ int picks[G53_EC_MAX_PICKS];
    __shared__ int keys[G53_EC_MAX_PICKS];
    __shared__ int miss_keys[G53_EC_MAX_PICKS];
    const int lane = threadIdx.x;
    const int first = layer * ec->n_experts;
    const uint32_t stamp = ec->stamp + 1;

    for (int i = lane; i < n_sel; i += 32) {
        int64_t e = sel[i];
        picks[i] = (e < 0 || e >= ec->n_experts) ? -1 : first + (int)e;  // masked picks skipped
    }
    __syncwarp();

    // dedup in order of first appearance
    int base = 0;
    for (int i0 = 0; i0 < n_sel; i0 += 32) {
        int i = i0 + lane;
        bool keep = false;
        if (i < n_sel && picks[i] >= 0) {
            keep = true;
            for (int j = 0; j < i; j++) keep &= picks[j] != picks[i];
        }
        unsigned m = __ballot_sync(0xffffffffu, keep);
        if (keep) keys[base + __popc(m & ((1u << lane) - 1))] = picks[i];
        base += __popc(m);
    }
    int n = base;

    // lookups: hits set the reference bit and are pinned (stamped) for this call; every
    // distinct key counts one lookup for the admission filter
    const bool filter = ec->freq_window > 0;
    int hits = 0, mbase = 0;
    for (int j0 = 0; j0 < n; j0 += 32) {
        int j = j0 + lane;
        bool miss = false;
        if (j < n) {
            if (filter && ec->key_freq[keys[j]] != 0xffffffffu) ec->key_freq[keys[j]]++;
            int s = ec->key_slot[keys[j]];
            if (s >= 0) {
                ec->slot_ref[s] = 1;
                ec->slot_stamp[s] = stamp;
                hits++;
            } else {
                miss = true;
            }
        }
        unsigned m = __ballot_sync(0xffffffffu, miss);
        if (miss) miss_keys[mbase + __popc(m & ((1u << lane) - 1))] = keys[j];
        mbase += __popc(m);
    }
    for (int off = 16; off > 0; off >>= 1) hits += __shfl_down_sync(0xffffffffu, hits, off);
    int n_miss = mbase;
    if (lane == 0) {
        ec->stamp = stamp;
        ec->n_jobs = 0;
        ec->hits += hits;
        ec->misses += n_miss;
        ec->layer_hits[layer] += hits;
        ec->layer_misses[layer] += n_miss;
    }
    __syncwarp();
    if (filter) {  // aging: halve every count once a window of lookups has passed
        int64_t events = ec->freq_events + n;
        if (events >= ec->freq_window) {
            for (int k = lane; k < ec->n_keys; k += 32) ec->key_freq[k] >>= 1;
            events >>= 1;
        }
        __syncwarp();
        if (lane == 0) ec->freq_events = events;
    }
    __syncwarp();
    if (!admit) return;

    const int n_active = ec->n_active;
    int hand = ec->hand;
    int n_jobs = 0;
    uint64_t skips = 0, evictions = 0, no_victim = 0, rejected = 0;
    for (int j = 0; j < n_miss; j++) {
        int key = miss_keys[j];
        // a free slot first (lowest index)
        int victim = -1;
        bool took_free = false;
        for (int s0 = 0; ec->n_used < n_active && s0 < n_active && victim < 0; s0 += 32) {
            int s = s0 + lane;
            unsigned m = __ballot_sync(0xffffffffu, s < n_active && ec->slot_key[s] < 0);
            if (m) { victim = s0 + __ffs(m) - 1; took_free = true; }
        }
        // else the hand: pass referenced slots (clearing their bit) and pinned ones
        for (int scanned = 0; victim < 0 && scanned < 2 * n_active + 32; scanned += 32) {
            int s = (hand + lane) % n_active;
            bool in_range = lane < n_active;
            bool pinned = in_range && ec->slot_stamp[s] == stamp;
            bool ref = in_range && !pinned && ec->slot_ref[s];
            bool cand = in_range && !pinned && !ref;
            unsigned m = __ballot_sync(0xffffffffu, cand);
            int stop = m ? __ffs(m) - 1 : min(32, n_active);  // lanes before stop were passed
            if (lane < stop && ref) ec->slot_ref[s] = 0;
            skips += __popc(__ballot_sync(0xffffffffu, lane < stop && pinned));
            if (m) victim = (hand + stop) % n_active;
            hand = (hand + stop + (m ? 1 : 0)) % n_active;
            __syncwarp();
        }
        __syncwarp();
        if (victim < 0) { no_victim++; continue; }  // stays zero-copy: still exact
        // the filter: a miss colder than the victim stays zero-copy and the victim stays
        // (all lanes read the same counts, so the branch is warp-uniform)
        if (filter && !took_free && ec->slot_key[victim] >= 0 &&
            ec->key_freq[key] <= ec->key_freq[ec->slot_key[victim]]) {
            rejected++;
            continue;
        }
        if (lane == 0) {
            int old = ec->slot_key[victim];
            if (old >= 0) {
                ec->key_slot[old] = -1;
                point_tables(ec, old, ec->home[old]);
                evictions++;
            }
            if (took_free) ec->n_used++;
            ec->slot_key[victim] = key;
            ec->key_slot[key] = victim;
            ec->slot_ref[victim] = 0;
            ec->slot_stamp[victim] = stamp;
            int64_t dst = (int64_t)(ec->slot_base + (int64_t)victim * ec->slot_bytes);
            ec->job_src[n_jobs] = ec->home[key];
            ec->job_dst[n_jobs] = dst;
            point_tables(ec, key, dst);
        }
        n_jobs++;
        __syncwarp();
    }
    if (lane == 0) {
        ec->hand = hand;
        ec->n_jobs = n_jobs;
        ec->admits += n_jobs;
        ec->evictions += evictions;
        ec->pinned_skips += skips;
        ec->no_victim += no_victim;
        ec->rejected += rejected;
    }
}

__global__ void copy_kernel(g53_ec *ec)
{
    int n_jobs = ec->n_jobs;
    copy_records(ec->job_src, ec->job_dst, n_jobs, ec->slot_bytes);
    if (blockIdx.x == 0 && threadIdx.x == 0) ec->bytes_copied += (uint64_t)n_jobs * ec->slot_bytes;
}

// One block of 1024 threads; experts in order, ballot prefix sums give staging indices.
__global__ void stage_kernel(g53_ec *ec, int layer, uint8_t *buf, int buf_slots, int64_t *job_src,
                             int64_t *job_dst, int32_t *n_jobs)
{
    __shared__ int warp_counts[32];
    __shared__ int base_s;
    const int n_exp = ec->n_experts;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    if (threadIdx.x == 0) base_s = 0;
    __syncthreads();
    for (int e0 = 0; e0 < n_exp; e0 += blockDim.x) {
        int e = e0 + threadIdx.x;
        int key = layer * n_exp + e;
        bool want = e < n_exp && ec->key_slot[key] < 0;
        unsigned m = __ballot_sync(0xffffffffu, want);
        if (lane == 0) warp_counts[warp] = __popc(m);
        __syncthreads();
        int before = base_s;
        for (int w = 0; w < warp; w++) before += warp_counts[w];
        int idx = before + __popc(m & ((1u << lane) - 1));
        if (want && idx < buf_slots) {
            int64_t dst = (int64_t)(buf + (int64_t)idx * ec->slot_bytes);
            job_src[idx] = ec->home[key];
            job_dst[idx] = dst;
            point_tables(ec, key, dst);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int total = 0;
            for (int w = 0; w < n_warps; w++) total += warp_counts[w];
            base_s += total;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) *n_jobs = min(base_s, buf_slots);
}

// Range staging: buf holds a copy of the first `count` records of the layer's home arena
// (expert e at e * slot_bytes, made on a copy engine; the whole arena when count covers the
// layer); the entries of every uncached expert e < count point there.
__global__ void stage_layer_kernel(g53_ec *ec, int layer, uint8_t *buf, int count)
{
    int end = count < ec->n_experts ? count : ec->n_experts;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < end; e += gridDim.x * blockDim.x) {
        int key = layer * ec->n_experts + e;
        if (ec->key_slot[key] < 0) point_tables(ec, key, (int64_t)(buf + (int64_t)e * ec->slot_bytes));
    }
}

__global__ void unstage_kernel(g53_ec *ec, int layer)
{
    for (int e = threadIdx.x; e < ec->n_experts; e += blockDim.x) {
        int key = layer * ec->n_experts + e;
        point_tables(ec, key, resident_base(ec, key));
    }
}

__global__ void copy_jobs_kernel(const int64_t *job_src, const int64_t *job_dst,
                                 const int32_t *n_jobs, int64_t bytes)
{
    copy_records(job_src, job_dst, *n_jobs, bytes);
}

__global__ void reset_kernel(g53_ec *ec)
{
    for (int key = blockIdx.x * blockDim.x + threadIdx.x; key < ec->n_keys;
         key += gridDim.x * blockDim.x)
        point_tables(ec, key, resident_base(ec, key));
}

// nvme-exact (the home table is rewritten by the host: home[key] is the key's RAM-tier slot, or
// `absent`, a poison record, when no RAM slot holds it). check_homes runs before route: every
// pick in no VRAM slot whose home is absent is counted in *bad (route would copy or point at
// the poison record: the host fails the step and flushes the cache). point_picks runs after
// route and copy: every pick's entries go to its slot or its home, since a home moves between
// RAM slots while exllamav3's entry still names the old one. Grid-stride, any n_sel.
__global__ void check_homes_kernel(const g53_ec *ec, const int64_t *sel, int n_sel, int layer,
                                   int64_t absent, unsigned long long *bad)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n_sel; i += gridDim.x * blockDim.x) {
        int64_t e = sel[i];
        if (e < 0 || e >= ec->n_experts) continue;  // masked picks
        int key = layer * ec->n_experts + (int)e;
        if (ec->key_slot[key] < 0 && ec->home[key] == absent) atomicAdd(bad, 1ull);
    }
}

__global__ void point_picks_kernel(g53_ec *ec, const int64_t *sel, int n_sel, int layer,
                                   int64_t absent)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n_sel; i += gridDim.x * blockDim.x) {
        int64_t e = sel[i];
        if (e < 0 || e >= ec->n_experts) continue;
        int key = layer * ec->n_experts + (int)e;
        int64_t base = resident_base(ec, key);
        if (base != absent) point_tables(ec, key, base);  // absent: counted by check_homes
    }
}

int status(void)
{
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? 0 : (int)e;
}

}  // namespace

extern "C" int g53_ec_route(g53_ec *ec, const int64_t *sel, int n_sel, int layer, int admit,
                            uintptr_t stream)
{
    if (!ec || !sel || n_sel < 0 || layer < 0) return G53_CU_EINVAL;
    if (n_sel > G53_EC_MAX_PICKS) return G53_CU_ETOOMANY;
    route_kernel<<<1, 32, 0, (cudaStream_t)stream>>>(ec, sel, n_sel, layer, admit);
    return status();
}

extern "C" int g53_ec_copy(g53_ec *ec, int n_blocks, uintptr_t stream)
{
    if (!ec || n_blocks <= 0) return G53_CU_EINVAL;
    copy_kernel<<<n_blocks, 256, 0, (cudaStream_t)stream>>>(ec);
    return status();
}

extern "C" int g53_ec_reset_tables(g53_ec *ec, uintptr_t stream)
{
    if (!ec) return G53_CU_EINVAL;
    reset_kernel<<<64, 256, 0, (cudaStream_t)stream>>>(ec);
    return status();
}

extern "C" int g53_ec_stage(g53_ec *ec, int layer, uint8_t *buf, int buf_slots, int64_t *job_src,
                            int64_t *job_dst, int32_t *n_jobs, uintptr_t stream)
{
    if (!ec || !buf || buf_slots <= 0 || !job_src || !job_dst || !n_jobs || layer < 0)
        return G53_CU_EINVAL;
    stage_kernel<<<1, 1024, 0, (cudaStream_t)stream>>>(ec, layer, buf, buf_slots, job_src, job_dst,
                                                        n_jobs);
    return status();
}

extern "C" int g53_ec_stage_layer(g53_ec *ec, int layer, uint8_t *buf, int count,
                                  uintptr_t stream)
{
    if (!ec || !buf || layer < 0 || count < 1) return G53_CU_EINVAL;
    stage_layer_kernel<<<4, 256, 0, (cudaStream_t)stream>>>(ec, layer, buf, count);
    return status();
}

extern "C" int g53_memcpy_async(void *dst, const void *src, size_t nbytes, uintptr_t stream)
{
    if (!dst || !src) return G53_CU_EINVAL;
    cudaError_t e = cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, (cudaStream_t)stream);
    return e == cudaSuccess ? 0 : (int)e;
}

extern "C" int g53_ec_unstage(g53_ec *ec, int layer, uintptr_t stream)
{
    if (!ec || layer < 0) return G53_CU_EINVAL;
    unstage_kernel<<<1, 512, 0, (cudaStream_t)stream>>>(ec, layer);
    return status();
}

extern "C" int g53_copy_jobs(const int64_t *job_src, const int64_t *job_dst, const int32_t *n_jobs,
                             int64_t bytes, int n_blocks, uintptr_t stream)
{
    if (!job_src || !job_dst || !n_jobs || bytes <= 0 || bytes % 16 || n_blocks <= 0)
        return G53_CU_EINVAL;
    copy_jobs_kernel<<<n_blocks, 256, 0, (cudaStream_t)stream>>>(job_src, job_dst, n_jobs, bytes);
    return status();
}

extern "C" int g53_ec_check_homes(g53_ec *ec, const int64_t *sel, int n_sel, int layer,
                                  int64_t absent, uint64_t *bad, uintptr_t stream)
{
    if (n_sel == 0) return 0;  // nothing to do, whatever the pointers (an empty tensor's is null)
    if (!ec || !sel || !bad || n_sel < 0 || layer < 0) return G53_CU_EINVAL;
    int blocks = (n_sel + 255) / 256;
    check_homes_kernel<<<blocks < 64 ? blocks : 64, 256, 0, (cudaStream_t)stream>>>(
        ec, sel, n_sel, layer, absent, reinterpret_cast<unsigned long long *>(bad));
    return status();
}

extern "C" int g53_ec_point_picks(g53_ec *ec, const int64_t *sel, int n_sel, int layer,
                                  int64_t absent, uintptr_t stream)
{
    if (n_sel == 0) return 0;  // nothing to do, whatever the pointers (an empty tensor's is null)
    if (!ec || !sel || n_sel < 0 || layer < 0) return G53_CU_EINVAL;
    int blocks = (n_sel + 255) / 256;
    point_picks_kernel<<<blocks < 64 ? blocks : 64, 256, 0, (cudaStream_t)stream>>>(
        ec, sel, n_sel, layer, absent);
    return status();
}

extern "C" int g53_host_register(void *ptr, size_t nbytes)
{
    if (!ptr || nbytes == 0) return G53_CU_EINVAL;
    cudaError_t e = cudaHostRegister(ptr, nbytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
    return e == cudaSuccess ? 0 : (int)e;
}

extern "C" int g53_host_unregister(void *ptr)
{
    cudaError_t e = cudaHostUnregister(ptr);
    return e == cudaSuccess ? 0 : (int)e;
}

extern "C" int g53_host_device_pointer(void *ptr, uintptr_t *dev_ptr)
{
    void *d = nullptr;
    cudaError_t e = cudaHostGetDevicePointer(&d, ptr, 0);
    *dev_ptr = (uintptr_t)d;
    return e == cudaSuccess ? 0 : (int)e;
}

extern "C" int g53_stream_sync(uintptr_t stream)
{
    cudaError_t e = cudaStreamSynchronize((cudaStream_t)stream);
    return e == cudaSuccess ? 0 : (int)e;
}

#define G53_OFF(f) offsets[n++] = (int64_t)offsetof(g53_ec, f)
extern "C" int g53_ec_layout(int64_t *offsets, int cap)
{
    if (cap < 34) return G53_CU_EINVAL;
    int n = 0;
    G53_OFF(n_slots); G53_OFF(n_active); G53_OFF(n_keys); G53_OFF(n_experts); G53_OFF(n_layers);
    G53_OFF(hand); G53_OFF(stamp); G53_OFF(n_jobs); G53_OFF(n_used); G53_OFF(slot_bytes);
    G53_OFF(part_off); G53_OFF(slot_base); G53_OFF(key_slot); G53_OFF(slot_key); G53_OFF(slot_ref);
    G53_OFF(slot_stamp); G53_OFF(home); G53_OFF(tables); G53_OFF(job_src); G53_OFF(job_dst);
    G53_OFF(layer_hits); G53_OFF(layer_misses); G53_OFF(hits); G53_OFF(misses); G53_OFF(admits);
    G53_OFF(evictions); G53_OFF(pinned_skips); G53_OFF(no_victim); G53_OFF(bytes_copied);
    G53_OFF(key_freq); G53_OFF(freq_window); G53_OFF(freq_events); G53_OFF(rejected);
    offsets[n++] = (int64_t)sizeof(g53_ec);
    return n;
}

extern "C" const char *g53_cuda_strerror(int code)
{
    switch (code) {
    case 0: return "ok";
    case G53_CU_EINVAL: return "invalid argument";
    case G53_CU_ENOMEM: return "out of memory";
    case G53_CU_ETOOMANY: return "too many picks in one call (max G53_EC_MAX_PICKS)";
    default: return code > 0 ? cudaGetErrorString((cudaError_t)code) : "unknown error";
    }
}
