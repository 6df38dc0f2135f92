/* lane_mailbox.h: the GPU <-> CPU-lane hand-off of fast mode, one mailbox per MoE layer-slot.
 *
 * A mailbox is one pinned, mapped host buffer (cudaHostRegister'ed on the GPU path; plain memory
 * in CI) that the device writes and reads through its UVA address and the lane through its host
 * address. Plain C, no Python, no CUDA: cuda/lane.cu includes it for the same offsets.
 *
 * Layout (byte offsets from the start of the buffer; H = hidden; every section 64-byte aligned):
 *   0     device line (written by the device only)
 *           +0  uint32 seq       bumped once per published step, written LAST
 *           +4  int32  n_picks   0..G53_MBOX_MAX_PICKS picks below
 *           +8  int32  n_rows    1..G53_MBOX_MAX_ROWS input rows below
 *           +12 int32  layer     the MoE layer (for stats and error messages)
 *           +16 int32  n_hit     the step's VRAM-cache hits and misses (distinct experts), for
 *           +20 int32  n_miss    the router's rates
 *   64    host line (written by the host only)
 *           +0  uint32 done      the last seq whose partial is final, release-stored by the lane
 *           +4  int32  status    0, or the gemv status of the last job that failed
 *           +8  uint32 budget    most lane experts the device may send this layer (the router's
 *                                split, updated between steps; 0 = the lane takes nothing)
 *   128   picks   { int32 row, int32 expert, float weight } [G53_MBOX_MAX_PICKS] (gemv_pick):
 *                 the coldest misses the device sends, weight = the router's weight (fp16 -> fp32)
 *   1024  rows    fp32 [G53_MBOX_MAX_ROWS][H]: the layer's MoE input, converted exactly from fp16
 *   1024 + 32 H   partial fp32 [G53_MBOX_MAX_ROWS][H]: sum over picks of weight * expert(row)
 *   total G53_MBOX_BYTES(H) = 1024 + 64 H  (263,168 bytes at H = 4096)
 *
 * Protocol and memory ordering, per step:
 *   device: write picks, rows, then n_picks, n_rows, layer, n_hit, n_miss;
 *           __threadfence_system(); st.release.sys seq = s (its own counter, never read back).
 *   lane:   seq read with acquire; a new s: read the payload, compute into private scratch; if
 *           seq is still s, copy the partial in and release-store done = s; if seq moved on, the
 *           device gave up on s: the result is dropped (counted as discarded).
 *   device: spins (bounded) until an acquire load of done equals s, then reads the partial. A
 *           done for any other seq is ignored, so a late result can never land in a later step:
 *           the partial of s is only read after done == s, and the lane writes partials in seq
 *           order, each one whole before its done.
 * A result computed from a payload the device was overwriting (it timed out and published the
 * next step meanwhile) is never read: its done is an old seq. The lane checks every pick before
 * it runs, so a torn payload cannot make it read out of bounds.
 */
#ifndef GLM53_LANE_MAILBOX_H
#define GLM53_LANE_MAILBOX_H

#include <stddef.h>
#include <stdint.h>

#define G53_MBOX_MAX_ROWS 8
#define G53_MBOX_MAX_PICKS 64

#define G53_MBOX_SEQ 0
#define G53_MBOX_N_PICKS 4
#define G53_MBOX_N_ROWS 8
#define G53_MBOX_LAYER 12
#define G53_MBOX_N_HIT 16
#define G53_MBOX_N_MISS 20
#define G53_MBOX_DONE 64
#define G53_MBOX_STATUS 68
#define G53_MBOX_BUDGET 72
#define G53_MBOX_PICKS 128
#define G53_MBOX_PICK_BYTES 12
#define G53_MBOX_ROWS 1024
#define G53_MBOX_PARTIAL(hidden) (G53_MBOX_ROWS + (size_t)G53_MBOX_MAX_ROWS * (size_t)(hidden) * 4)
#define G53_MBOX_BYTES(hidden) (G53_MBOX_ROWS + 2 * (size_t)G53_MBOX_MAX_ROWS * (size_t)(hidden) * 4)

#endif
