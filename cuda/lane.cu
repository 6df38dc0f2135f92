// Fast mode's device side of the CPU-lane hand-off: publish, bounded wait + combine, select.
// See lane_cuda.h for the per-layer sequence and pyx/lane_mailbox.h for the layout and protocol.
// NOT YET RUN ON A GPU (compiled only); tests/gpu/test_lane_mailbox_gpu.py is its test.
#include <cstddef>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "glm53_cuda.h"
#include "lane_cuda.h"
#include "lane_mailbox.h"

namespace {

constexpr int PUBLISH_THREADS = 256;
constexpr int WAIT_THREADS = 1024;

__device__ __forceinline__ void store_release_sys(uint32_t *p, uint32_t v)
{
    asm volatile("st.release.sys.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t *p)
{
    uint32_t v;
    asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ uint64_t globaltimer_ns()
{
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ float half_bits_to_float(uint16_t bits)
{
    return __half2float(__ushort_as_half(bits));
}

// One block. Thread 0 chooses (n_sel <= 64: a serial pass is a few hundred instructions); every
// thread copies rows.
__global__ void publish_kernel(g53_lane_dev *dev, int64_t *sel, uint16_t *rw, const uint16_t *x,
                               int n_rows, int top_k, int hidden, int64_t x_stride,
                               const int32_t *key_slot, uint32_t *key_score,
                               const int32_t *key_lane, int key_base, int n_experts,
                               int64_t *orig_sel, uint16_t *orig_w, int layer)
{
    __shared__ int n_picks;
    uint8_t *mb = dev->mbox;
    const int n_sel = n_rows * top_k;
    for (int s = threadIdx.x; s < n_sel; s += blockDim.x) {
        orig_sel[s] = sel[s];
        orig_w[s] = rw[s];
    }
    __syncthreads();  // every saved pick read before thread 0 masks any
    if (threadIdx.x == 0) {
        int uniq[G53_MBOX_MAX_PICKS];
        int32_t lane_ix[G53_MBOX_MAX_PICKS];  // the pick's lane-table index, < 0: not for the lane
        uint32_t score[G53_MBOX_MAX_PICKS];
        bool miss[G53_MBOX_MAX_PICKS], take[G53_MBOX_MAX_PICKS];
        int n_uniq = 0, n_hit = 0, n_miss = 0;
        for (int s = 0; s < n_sel; s++) {
            int64_t e = sel[s];
            if (e < 0 || e >= n_experts || half_bits_to_float(rw[s]) == 0.0f) continue;  // masked
            int u = 0;
            while (u < n_uniq && uniq[u] != (int)e) u++;
            if (u < n_uniq) continue;
            uniq[u] = (int)e;
            miss[u] = key_slot == nullptr || key_slot[key_base + e] < 0;
            lane_ix[u] = key_lane ? key_lane[key_base + e] : (int32_t)e;
            score[u] = key_score ? key_score[key_base + e] : 0u;
            take[u] = false;
            n_uniq++;
            n_hit += !miss[u];
            n_miss += miss[u];
        }
        uint32_t budget = *(volatile uint32_t *)(mb + G53_MBOX_BUDGET);
        for (uint32_t k = 0; k < budget; k++) {  // the coldest miss not taken yet, ties in order
            int best = -1;  // (only a miss the lane can take: lane_ix >= 0, nvme: in the RAM tier)
            for (int u = 0; u < n_uniq; u++)
                if (miss[u] && lane_ix[u] >= 0 && !take[u] &&
                    (best < 0 || score[u] < score[best]))
                    best = u;
            if (best < 0) break;
            take[best] = true;
            // one lookup, as the cache's route would have counted it: an expert the lane keeps
            // taking grows hotter until it is no longer the coldest, and the route sees it again
            if (key_score && score[best] != 0xffffffffu) key_score[key_base + uniq[best]]++;
        }
        int n = 0;
        int32_t *picks = (int32_t *)(mb + G53_MBOX_PICKS);
        for (int s = 0; s < n_sel; s++) {
            int64_t e = sel[s];
            if (e < 0 || e >= n_experts || half_bits_to_float(rw[s]) == 0.0f) continue;
            int u = 0;
            while (uniq[u] != (int)e) u++;
            if (!take[u]) continue;
            volatile int32_t *pk = picks + 3 * n++;
            pk[0] = s / top_k;
            pk[1] = lane_ix[u];  // the lane's table index: the expert, or (nvme) its RAM slot
            pk[2] = __float_as_int(half_bits_to_float(rw[s]));
            sel[s] = -1;  // exllamav3 skips weight 0; the VRAM cache's route skips id -1
            rw[s] = 0;
        }
        *(volatile int32_t *)(mb + G53_MBOX_N_HIT) = n_hit;
        *(volatile int32_t *)(mb + G53_MBOX_N_MISS) = n_miss;
        n_picks = n;
    }
    __syncthreads();
    const int n = n_picks;
    if (n > 0) {
        float *rows = (float *)(mb + G53_MBOX_ROWS);
        for (int i = threadIdx.x; i < n_rows * hidden; i += blockDim.x) {
            int r = i / hidden, j = i - r * hidden;
            rows[i] = half_bits_to_float(x[r * x_stride + j]);  // exact: fp16 fits fp32
        }
    }
    __threadfence_system();  // each thread's payload writes, before the seq below
    __syncthreads();
    if (threadIdx.x == 0) {
        dev->pending = n > 0;
        dev->timed_out = 0;
        dev->n_sel = n_sel;
        if (n > 0) {
            *(volatile int32_t *)(mb + G53_MBOX_N_PICKS) = n;
            *(volatile int32_t *)(mb + G53_MBOX_N_ROWS) = n_rows;
            *(volatile int32_t *)(mb + G53_MBOX_LAYER) = layer;
            __threadfence_system();
            uint32_t seq = dev->seq + 1;
            store_release_sys((uint32_t *)(mb + G53_MBOX_SEQ), seq);
            dev->seq = seq;
            dev->published++;
            dev->lane_picks += n;
        }
    }
}

// One block: thread 0 waits, then every thread combines (8 x 4096 floats: 32 per thread).
__global__ void wait_kernel(g53_lane_dev *dev, const float *out, int n_rows, int hidden,
                            int64_t out_stride, float *acc, int64_t *fb_sel, uint16_t *fb_w,
                            const int64_t *orig_sel, const uint16_t *orig_w, int64_t budget_ns)
{
    __shared__ int ok;
    uint8_t *mb = dev->mbox;
    const bool pending = dev->pending != 0;
    if (threadIdx.x == 0) {
        int got = 1;
        if (pending) {
            const uint32_t seq = dev->seq;
            const uint32_t *done = (const uint32_t *)(mb + G53_MBOX_DONE);
            const uint64_t t0 = globaltimer_ns();
            while (load_acquire_sys(done) != seq) {  // a done of an older seq never counts
                if ((int64_t)(globaltimer_ns() - t0) > budget_ns) {
                    got = 0;
                    break;
                }
                __nanosleep(256);
            }
            dev->timed_out = !got;
            if (!got) dev->fallbacks++;
        }
        ok = got;
    }
    __syncthreads();
    const bool add = ok && pending;
    const float *partial = (const float *)(mb + G53_MBOX_PARTIAL(hidden));
    for (int i = threadIdx.x; i < n_rows * hidden; i += blockDim.x) {
        int r = i / hidden, j = i - r * hidden;
        float v = out[r * out_stride + j];
        if (add) v += __ldcv(partial + i);  // uncached: the lane wrote it after our last look
        acc[i] = v;
    }
    const int n_sel = dev->n_sel;
    for (int s = threadIdx.x; s < n_sel; s += blockDim.x) {
        fb_sel[s] = ok ? -1 : orig_sel[s];
        fb_w[s] = ok ? 0 : orig_w[s];
    }
}

__global__ void select_kernel(const g53_lane_dev *dev, float *out, const float *acc, int n_rows,
                              int hidden, int64_t out_stride)
{
    if (dev->timed_out) return;  // out holds the fallback call's whole-layer answer
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n_rows * hidden;
         i += gridDim.x * blockDim.x) {
        int r = i / hidden, j = i - r * hidden;
        out[r * out_stride + j] = acc[i];
    }
}

int launch_status() { return (int)cudaGetLastError(); }

}  // namespace

extern "C" {

int g53_lane_publish(g53_lane_dev *dev, int64_t *sel, uint16_t *rw, const uint16_t *x,
                     int n_rows, int top_k, int hidden, int64_t x_stride, const int32_t *key_slot,
                     uint32_t *key_score, const int32_t *key_lane, int key_base, int n_experts,
                     int64_t *orig_sel, uint16_t *orig_w, int layer, uintptr_t stream)
{
    if (!dev || !sel || !rw || !x || !orig_sel || !orig_w || n_rows < 1 ||
        n_rows > G53_MBOX_MAX_ROWS || top_k < 1 || n_rows * top_k > G53_MBOX_MAX_PICKS ||
        hidden <= 0 || hidden % 128 || x_stride < hidden || n_experts < 1 || key_base < 0)
        return G53_CU_EINVAL;
    publish_kernel<<<1, PUBLISH_THREADS, 0, (cudaStream_t)stream>>>(
        dev, sel, rw, x, n_rows, top_k, hidden, x_stride, key_slot, key_score, key_lane,
        key_base, n_experts, orig_sel, orig_w, layer);
    return launch_status();
}

int g53_lane_wait(g53_lane_dev *dev, const float *out, int n_rows, int hidden, int64_t out_stride,
                  float *acc, int64_t *fb_sel, uint16_t *fb_w, const int64_t *orig_sel,
                  const uint16_t *orig_w, int64_t budget_ns, uintptr_t stream)
{
    if (!dev || !out || !acc || !fb_sel || !fb_w || !orig_sel || !orig_w || n_rows < 1 ||
        n_rows > G53_MBOX_MAX_ROWS || hidden <= 0 || hidden % 128 || out_stride < hidden ||
        budget_ns < 0)
        return G53_CU_EINVAL;
    wait_kernel<<<1, WAIT_THREADS, 0, (cudaStream_t)stream>>>(
        dev, out, n_rows, hidden, out_stride, acc, fb_sel, fb_w, orig_sel, orig_w, budget_ns);
    return launch_status();
}

int g53_lane_select(g53_lane_dev *dev, float *out, const float *acc, int n_rows, int hidden,
                    int64_t out_stride, uintptr_t stream)
{
    if (!dev || !out || !acc || n_rows < 1 || n_rows > G53_MBOX_MAX_ROWS || hidden <= 0 ||
        out_stride < hidden)
        return G53_CU_EINVAL;
    int blocks = (n_rows * hidden + 1023) / 1024;
    select_kernel<<<blocks, 256, 0, (cudaStream_t)stream>>>(dev, out, acc, n_rows, hidden,
                                                            out_stride);
    return launch_status();
}

int g53_lane_dev_layout(int64_t *offsets, int cap)
{
    const int64_t offs[] = {
        (int64_t)offsetof(g53_lane_dev, mbox),      (int64_t)offsetof(g53_lane_dev, seq),
        (int64_t)offsetof(g53_lane_dev, pending),   (int64_t)offsetof(g53_lane_dev, timed_out),
        (int64_t)offsetof(g53_lane_dev, n_sel),     (int64_t)offsetof(g53_lane_dev, published),
        (int64_t)offsetof(g53_lane_dev, lane_picks), (int64_t)offsetof(g53_lane_dev, fallbacks),
        (int64_t)sizeof(g53_lane_dev),
    };
    int n = (int)(sizeof offs / sizeof offs[0]);
    if (cap < n) return G53_CU_EINVAL;
    for (int i = 0; i < n; i++) offsets[i] = offs[i];
    return n;
}

int g53_lane_mbox_layout(int hidden, int64_t *offsets, int cap)
{
    const int64_t offs[] = {G53_MBOX_SEQ,     G53_MBOX_DONE, G53_MBOX_BUDGET,
                            G53_MBOX_PICKS,   G53_MBOX_ROWS, (int64_t)G53_MBOX_PARTIAL(hidden),
                            (int64_t)G53_MBOX_BYTES(hidden)};
    int n = (int)(sizeof offs / sizeof offs[0]);
    if (cap < n || hidden <= 0) return G53_CU_EINVAL;
    for (int i = 0; i < n; i++) offsets[i] = offs[i];
    return n;
}

}  // extern "C"
