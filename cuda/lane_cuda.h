/* Fast mode's device side of the GPU <-> CPU-lane hand-off (cuda/lane.cu): C ABI, no Python, no
 * libtorch. The mailbox layout and the protocol are pyx/lane_mailbox.h's.
 *
 * NOT YET RUN ON A GPU: these kernels compile (nvcc 13) and their host side is tested in CI
 * against a host thread that mocks them (tests/test_lane_mailbox.py); tests/gpu/
 * test_lane_mailbox_gpu.py is the test that runs them, written for the next GPU session.
 *
 * Per MoE layer and decode step (bsz <= 8, exllamav3 1.6.5's fused decode path), all on the
 * caller's stream, no host sync:
 *   1 g53_lane_publish, after the router and before the VRAM cache's route: saves the selection
 *     (orig_*), takes up to the mailbox's budget of the coldest missed experts (lowest key_score,
 *     ties in pick order; key_slot < 0 is a miss), writes their picks (row, expert, router weight
 *     fp16 -> fp32) and the fp16 input rows as fp32 into the mailbox, fences, release-stores seq,
 *     and masks those picks in the live selection as expert -1 with weight 0. exllamav3's decode
 *     kernel skips a pick whose weight is 0 (exl3_moe_coop_kernel.cuh slot_info: active = w != 0,
 *     and the id is never read then; an id of -1 with a nonzero weight would index table[-1]),
 *     and g53_ec_route skips an id < 0, so a lane pick is neither computed nor admitted.
 *   2 exllamav3's MoE call (run_bszN) computes the rest into its fp32 routed sum `out`.
 *   3 g53_lane_wait spins on done up to budget_ns (%globaltimer: the SM clock moves with boost).
 *     Done == seq: acc = out + partial (the partial already carries the router weights: the lane
 *     multiplies each pick by its weight as the GPU kernel would, so it is added unscaled), and
 *     the fallback selection is all masked. Timeout (or any done but seq): acc = out, the
 *     fallback selection is the whole saved selection, and the fallback is counted.
 *   4 the caller runs exllamav3's MoE call again on the fallback selection, into `out`. A whole
 *     layer is recomputed there, not the lane's picks alone: exllamav3's decode kernel always
 *     merges the shared expert into its output, so a second call for a few picks would add the
 *     shared expert twice. On timeout that output is exact mode's answer for the layer (the
 *     lane's experts read zero-copy from their home); on success it is discarded.
 *   5 g53_lane_select: out = acc unless the wait timed out.
 * Cost on the happy path beyond the lane's: the publish (one block), the partial's read over the
 * link (n_rows * hidden * 4 bytes), two fp32 copies of `out`, and the masked second call (its
 * launches and the shared expert). Not measured yet.
 */
#ifndef GLM53_LANE_CUDA_H
#define GLM53_LANE_CUDA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Device state of one layer-slot's hand-off; in device memory, owned by the caller, zeroed once. */
typedef struct g53_lane_dev {
    uint8_t *mbox;       /* the mailbox's device (UVA) address */
    uint32_t seq;        /* last seq published (the device's own count; never read back) */
    int32_t pending;     /* 1 when the last publish sent picks to the lane */
    int32_t timed_out;   /* outcome of the last wait */
    int32_t n_sel;       /* picks (rows * top_k) of the last publish */
    uint64_t published;  /* seqs published */
    uint64_t lane_picks; /* picks sent to the lane */
    uint64_t fallbacks;  /* waits that timed out */
} g53_lane_dev;

/* sel int64 [n_rows * top_k] and rw fp16 bits [n_rows * top_k] (the router's, masked in place);
 * x fp16 [n_rows][x_stride] (the MoE input, hidden wide); key_slot int32 [n_keys] (the VRAM
 * cache's, NULL: every pick is a miss); key_score uint32 [n_keys] (the cache's lookup counts
 * key_freq, lowest first; NULL: pick order), read at key_base + expert, and counted up by one for
 * each expert taken, as the cache's route counts the lookups it sees; key_lane int32 [n_keys]
 * (NULL: the expert id, every miss may go) the index of the key's entry in the lane's expert
 * table, read at key_base + expert: a miss whose index is < 0 stays on the GPU (nvme mode: the
 * RAM tier does not hold it, so it is read from the store; the index is its RAM slot), and a
 * pick sent to the lane carries the index in its `expert` field; orig_sel/orig_w
 * [n_rows * top_k] receive the selection as routed.
 * n_rows 1..8, n_rows * top_k <= 64, hidden a multiple of 128. */
int g53_lane_publish(g53_lane_dev *dev, int64_t *sel, uint16_t *rw, const uint16_t *x,
                     int n_rows, int top_k, int hidden, int64_t x_stride, const int32_t *key_slot,
                     uint32_t *key_score, const int32_t *key_lane, int key_base, int n_experts,
                     int64_t *orig_sel, uint16_t *orig_w, int layer, uintptr_t stream);
/* out fp32 [n_rows][out_stride] (exllamav3's routed sum); acc fp32 [n_rows][hidden] (caller's
 * scratch); fb_sel/fb_w [n_sel] the fallback selection. */
int g53_lane_wait(g53_lane_dev *dev, const float *out, int n_rows, int hidden, int64_t out_stride,
                  float *acc, int64_t *fb_sel, uint16_t *fb_w, const int64_t *orig_sel,
                  const uint16_t *orig_w, int64_t budget_ns, uintptr_t stream);
int g53_lane_select(g53_lane_dev *dev, float *out, const float *acc, int n_rows, int hidden,
                    int64_t out_stride, uintptr_t stream);
/* Byte offsets of the g53_lane_dev fields in declaration order, then its size; returns how many
 * were written (<= cap). */
int g53_lane_dev_layout(int64_t *offsets, int cap);
/* The mailbox offsets this library was compiled with (seq, done, budget, picks, rows, partial
 * and bytes at hidden), for a check against the host side's. */
int g53_lane_mbox_layout(int hidden, int64_t *offsets, int cap);

#ifdef __cplusplus
}
#endif
#endif
