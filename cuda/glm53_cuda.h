/* glm53 CUDA library: C ABI, no Python, no libtorch. Tensors cross as raw device
 * addresses and streams as cudaStream_t passed as uintptr_t. */
#ifndef GLM53_CUDA_H
#define GLM53_CUDA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Error codes: 0 ok, > 0 a cudaError_t, < 0 one of these. */
#define G53_CU_EINVAL   (-1)
#define G53_CU_ENOMEM   (-2)
#define G53_CU_ETOOMANY (-3)

/* Most unique experts one route call may see (rows * top_k, deduplicated). */
#define G53_EC_MAX_PICKS 512

/* The device-side expert cache: a CLOCK table of VRAM slots over all MoE layers'
 * experts (key = moe_layer * n_experts + expert). Each slot holds one expert record:
 * gate, up and down trellis back to back at part_off[0..2]; home[key] is the device
 * (UVA) address of the same record in pinned host memory. tables[3 * layer + p] is
 * the device address of exllamav3's int64 pointer table for projection p of that
 * layer. All arrays live in device memory and are owned by the caller. */
typedef struct g53_ec {
    int32_t n_slots;       /* slots allocated */
    int32_t n_active;      /* slots in use (elastic: <= n_slots) */
    int32_t n_keys;
    int32_t n_experts;     /* per MoE layer */
    int32_t n_layers;      /* MoE layers */
    int32_t hand;
    uint32_t stamp;        /* bumped per route call: slots touched in a call are pinned for it */
    int32_t n_jobs;        /* copy jobs queued by the last route call */
    int32_t n_used;        /* slots holding a key (free ones are taken first) */
    int64_t slot_bytes;
    int64_t part_off[3];
    uint8_t *slot_base;
    int32_t *key_slot;     /* [n_keys], -1 when not cached */
    int32_t *slot_key;     /* [n_slots], -1 when free */
    uint8_t *slot_ref;     /* [n_slots] reference bits */
    uint32_t *slot_stamp;  /* [n_slots] */
    const int64_t *home;   /* [n_keys] record address in pinned host memory (UVA) */
    int64_t *tables;       /* [3 * n_layers] device addresses of int64 tables */
    int64_t *job_src;      /* [G53_EC_MAX_PICKS] */
    int64_t *job_dst;      /* [G53_EC_MAX_PICKS] */
    uint64_t *layer_hits;  /* [n_layers] */
    uint64_t *layer_misses;/* [n_layers] */
    uint64_t hits, misses, admits, evictions, pinned_skips, no_victim, bytes_copied;
    /* Admission filter (frequency-gated CLOCK, as in TinyLFU): every looked-up key counts one
     * in key_freq; a miss that needs an eviction is admitted only if it was looked up more
     * often than the CLOCK victim, else it stays zero-copy (still exact) and the victim stays.
     * After freq_window lookups every count is halved, so old popularity fades.
     * freq_window == 0 turns the filter off (every miss admitted: plain CLOCK). */
    uint32_t *key_freq;    /* [n_keys] */
    int64_t freq_window;
    int64_t freq_events;   /* lookups since the last halving */
    uint64_t rejected;     /* misses left zero-copy by the filter */
} g53_ec;

/* Route one MoE layer's picks (sel: int64 device array of n_sel expert ids of this
 * layer). admit = 1 admits misses into slots (decode; through the frequency filter when
 * freq_window > 0), 0 only counts (misses are read zero-copy from home). Queues copy jobs and rewrites table entries; then
 * g53_ec_copy must run on the same stream before the MoE kernel. */
int g53_ec_route(g53_ec *ec_dev, const int64_t *sel, int n_sel, int layer, int admit,
                 uintptr_t stream);
/* Copy the queued jobs' records from home to their slots; n_blocks CTAs. */
int g53_ec_copy(g53_ec *ec_dev, int n_blocks, uintptr_t stream);
/* Point every table entry of every layer at home; empties nothing (slots keep keys). */
int g53_ec_reset_tables(g53_ec *ec_dev, uintptr_t stream);

/* Prefill staging. stage: for every expert of `layer` that is not in a cache slot, in
 * expert order and up to buf_slots of them, queue a copy home -> buf[i] (job_src/job_dst,
 * *n_jobs) and point its table entries at buf[i]. unstage: point every entry of `layer` back
 * at its cache slot or its home. copy_jobs: run the queued copies (bytes each). */
int g53_ec_stage(g53_ec *ec_dev, int layer, uint8_t *buf, int buf_slots, int64_t *job_src,
                 int64_t *job_dst, int32_t *n_jobs, uintptr_t stream);
int g53_ec_unstage(g53_ec *ec_dev, int layer, uintptr_t stream);
/* Range staging: buf (count * slot_bytes) holds a copy of the first `count` records of the
 * layer's home arena (all n_experts of them when it fits), made with g53_memcpy_async (a copy
 * engine, no SMs taken from the layer computing meanwhile); point every uncached expert
 * e < count of `layer` at its record in buf. */
int g53_ec_stage_layer(g53_ec *ec_dev, int layer, uint8_t *buf, int count, uintptr_t stream);
/* cudaMemcpyAsync with cudaMemcpyDefault (pinned host <-> device through UVA). */
int g53_memcpy_async(void *dst, const void *src, size_t nbytes, uintptr_t stream);
int g53_copy_jobs(const int64_t *job_src, const int64_t *job_dst, const int32_t *n_jobs,
                  int64_t bytes, int n_blocks, uintptr_t stream);

/* nvme-exact: home[key] is rewritten by the host (the RAM-tier slot holding the key, or
 * `absent`). check_homes (before route) adds to *bad (device) one per pick that is in no VRAM
 * slot and whose home is absent; point_picks (after route and copy) points every pick's table
 * entries at its slot or its home (not at an absent one). Any n_sel, masked picks skipped. */
int g53_ec_check_homes(g53_ec *ec_dev, const int64_t *sel, int n_sel, int layer, int64_t absent,
                       uint64_t *bad, uintptr_t stream);
int g53_ec_point_picks(g53_ec *ec_dev, const int64_t *sel, int n_sel, int layer, int64_t absent,
                       uintptr_t stream);

/* Pinned host memory. */
int g53_host_register(void *ptr, size_t nbytes);
int g53_host_unregister(void *ptr);
int g53_host_device_pointer(void *ptr, uintptr_t *dev_ptr);
int g53_stream_sync(uintptr_t stream);

const char *g53_cuda_strerror(int code);
/* Byte offsets of the g53_ec fields, in declaration order, so the Python side can
 * check its mirror of the struct; returns the number of fields written (<= cap). */
int g53_ec_layout(int64_t *offsets, int cap);

#ifdef __cplusplus
}
#endif
#endif
