/* gemv_avx512_fast.c: the fast AVX-512 tile kernel (F/BW/VL + VBMI + VNNI; unrounded codebook,
 * int16 inputs; gemv_fast.h).
 *
 * A zmm holds one row pair (r, r + 1) of a tile: 32-bit lane k is column POS[k], its low 16 bits
 * the state at row r, its high 16 bits the state at row r + 1. So one vpdpwssd against the pair's
 * int16 inputs (broadcast) adds q[r] s + q[r+1] s' to each column, and a tile keeps one int32
 * accumulator per activation row. Per row pair (32 weights):
 *   vpermi2b       each 64-bit lane (columns c and c + 8) gets the stream bytes that hold its
 *                  windows, most significant first (the tile sits in two zmm; tiles wider than 128
 *                  bytes take two gathers blended on bit 7). Row pairs p and p + 4 (states t..t+5
 *                  and t+2..t+7 of a lane) share one gather where their eight windows fit 64 bits
 *                  (`shared`: K <= 4, two-zmm tiles): half a gather per row pair
 *   vpmultishiftqb each 16-bit lane picks its state's two bytes at any bit offset: the states,
 *                  with no shift or mask
 *   3 x vpmul*w, 2 x vpmaddubsw   the byte sums s, as in the AVX2 fast kernel
 *   vpdpwssd       per activation row
 * A tile's eight sums are decoded first, then each activation row runs its eight vpdpwssd from
 * them (the previous kernel interleaved rows and row pairs, which spilled at 3 rows and more).
 * The accumulator starts at -510 sum(q) (the centre, gemv_fast.h), so a tile ends with one
 * convert and one fma per activation row; whether the tile takes two or four zmm (K >= 4.5) and
 * whether gathers are shared are compile-time cases, not tests per row pair.
 *
 * Integer sums are exact, so the kernel's output is the scalar fast kernel's bit for bit, as the
 * previous one's (gemv_avx512_fast_v1.c, kept for same-process A/B: `bench/micro_gemv.py --ab`).
 *
 * Where the time goes (one thread, K = 3, kernel alone, 2-core Zen 4 EPYC VM; docs/fast-mode.md):
 * at one row 7 of the ~10 vector operations per row pair (the three multiplies, the two
 * vpmaddubsw, vpdpwssd and vpmultishiftqb) issue on Zen 4's one 512-bit integer-multiply pipe,
 * which is the limit (vpmultishiftqb replaced by an xor, or vpdpwssd by an add, results wrong:
 * 1.12x and 1.11x). Measured and
 * dropped (same-process A/B against this kernel's sequence): shift-based state extraction
 * (vpermi2b + vpsrlvd + vpsllvd + blend instead of vpmultishiftqb) 0.996x, a vpmaddubsw traded
 * for and + shift + add 0.95x (vpshufb instead of the shift, timed only: 0.91x), two
 * accumulator chains per row 1.00x,
 * -mtune variants 1.00x. This kernel against the previous one (`micro_gemv.py --ab`, package
 * build): 1.01x at one row, 1.00x at 2-8 rows; a standalone harness showed up to 1.2x at 8 rows
 * that moved with code layout (one more instantiation of tiles_m cost 12 % at one row), so
 * compare kernels only inside the package build. On Intel's server cores vpermi2b is, as far as
 * we know (uops.info's Ice Lake table, from memory: not checked or measured here), three uops,
 * so the shared gather would save 1.5 per row pair there: the H200 A/B in docs/fast-mode.md. */
#include <immintrin.h>
#include <pthread.h>
#include <string.h>

#include "gemv_fast.h"

/* Software prefetch distance in the trellis stream (about 21 tiles at K = 3), stopping at the
 * end of the call's tile rows. Kernel alone on the Zen 4 VM: 1.02x at two threads (5.90 against
 * 5.78 GB/s each, 3 of 3 runs), 1.01x at one; 1024 and 4096 bytes measure the same. Its point
 * is all-core load, where each thread's stream waits longer on DRAM. */
#define PREFETCH_BYTES 2048

typedef struct {
    _Alignas(64) uint8_t idx[8][64];   /* per row pair: byte of the tile for each qword byte */
    _Alignas(64) uint8_t shift[8][64]; /* per row pair: vpmultishiftqb control (bit offsets) */
    _Alignas(64) uint8_t gidx[4][64];   /* shared gather of row pairs p and p + 4 */
    _Alignas(64) uint8_t gshift[8][64]; /* row pair p's vpmultishiftqb control in its shared gather */
    int shared; /* every shared gather's windows fit their 64-bit lane (K <= 6) */
} fast_tables;

static fast_tables tables[17]; /* by k2 */
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

/* Column of lane k: qword j holds columns j and j + 8. */
static inline int lane_col(int k) { return (k >> 1) + 8 * (k & 1); }

static int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

static void build_tables(void)
{
    for (int k2 = 2; k2 <= 16; k2++) {
        int ring_bits = 128 * k2, ring_bytes = 16 * k2;
        for (int p = 0; p < 8; p++) { /* row pair p: rows 2 (p & 3) + 8 (p >> 2), + 1 */
            for (int j = 0; j < 8; j++) {
                /* the four states of qword j, in 16-bit lane order */
                int t0 = 32 * j + 8 * (p & 3) + 2 * (p >> 2);
                int ts[4] = {t0, t0 + 1, t0 + 4, t0 + 5};
                int first = floor_div(gemv_state_end(k2, t0) - 16, 8); /* stream byte, may be < 0 */
                for (int b = 0; b < 8; b++) { /* qword byte b = stream byte first + 7 - b */
                    int qs = ((first + 7 - b) % ring_bytes + ring_bytes) % ring_bytes;
                    tables[k2].idx[p][8 * j + b] = (uint8_t)gemv_stream_byte(qs);
                }
                for (int u = 0; u < 4; u++) {
                    int bit = gemv_state_end(k2, ts[u]) - 16 - 8 * first; /* 0..47 */
                    tables[k2].shift[p][8 * j + 2 * u] = (uint8_t)(48 - bit);
                    tables[k2].shift[p][8 * j + 2 * u + 1] = (uint8_t)(56 - bit);
                }
            }
        }
        (void)ring_bits;
        tables[k2].shared = 1;
        for (int p = 0; p < 4; p++) /* shared gather p: row pairs p and p + 4 */
            for (int j = 0; j < 8; j++) {
                /* lane j: pair p's states t0, +1, +4, +5; pair p + 4's t0 + 2, +3, +6, +7 */
                int t0 = 32 * j + 8 * p;
                int first = floor_div(gemv_state_end(k2, t0) - 16, 8);
                if (gemv_state_end(k2, t0 + 7) - 8 * first > 64)
                    tables[k2].shared = 0;
                for (int b = 0; b < 8; b++) {
                    int qs = ((first + 7 - b) % ring_bytes + ring_bytes) % ring_bytes;
                    tables[k2].gidx[p][8 * j + b] = (uint8_t)gemv_stream_byte(qs);
                }
                for (int half = 0; half < 2; half++) {
                    int tp = t0 + 2 * half, ts[4] = {tp, tp + 1, tp + 4, tp + 5};
                    for (int u = 0; u < 4; u++) { /* bit 0..48 where a fitting window starts */
                        int bit = gemv_state_end(k2, ts[u]) - 16 - 8 * first;
                        uint8_t *c = &tables[k2].gshift[p + 4 * half][8 * j + 2 * u];
                        c[0] = (uint8_t)((48 - bit) & 63), c[1] = (uint8_t)((56 - bit) & 63);
                    }
                }
            }
    }
}

/* The byte sums s (0..1020) of 32 states, as 16-bit lanes. */
static inline __attribute__((always_inline)) __m512i state_sums(__m512i state)
{
    const __m512i mlo = _mm512_set1_epi16((short)(GEMV_MUL1_MULT & 0xFFFF));
    const __m512i mhi = _mm512_set1_epi16((short)(GEMV_MUL1_MULT >> 16));
    const __m512i ones8 = _mm512_set1_epi8(1);
    __m512i lo = _mm512_mullo_epi16(state, mlo);
    __m512i hi = _mm512_add_epi16(_mm512_mulhi_epu16(state, mlo), _mm512_mullo_epi16(state, mhi));
    return _mm512_add_epi16(_mm512_maddubs_epi16(lo, ones8), _mm512_maddubs_epi16(hi, ones8));
}

/* Tile bytes picked by idx, from the tile in two (or four) zmm. */
static inline __attribute__((always_inline)) __m512i gather(const uint8_t *idx_table, __m512i t0,
                                                            __m512i t1, __m512i t2, __m512i t3,
                                                            const int wide)
{
    __m512i idx = _mm512_load_si512(idx_table);
    __m512i raw = _mm512_permutex2var_epi8(t0, idx, t1);
    if (wide)
        raw = _mm512_mask_blend_epi8(_mm512_movepi8_mask(idx), raw,
                                     _mm512_permutex2var_epi8(t2, idx, t3));
    return raw;
}

static inline __attribute__((always_inline)) __m512i pick(const uint8_t *shift_table, __m512i raw)
{
    return _mm512_multishift_epi64_epi8(_mm512_load_si512(shift_table), raw);
}

static inline __attribute__((always_inline)) void
tiles_m(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1, const float *xh,
        int x_stride, const int m, float *acc, const int wide, const int shared)
{
    const fast_tables *tab = &tables[k2];
    const size_t tile_bytes = (size_t)gemv_tile_bytes(k2), n = 16 * (size_t)n_tiles;
    /* Bytes of the last zmm load that lie inside the tile (masked: never reads past it). */
    const __mmask64 tail = tile_bytes % 64 ? ((__mmask64)1 << (tile_bytes % 64)) - 1 : ~(__mmask64)0;
    const int full1 = tile_bytes >= (wide ? 192 : 64), full2 = tile_bytes > (wide ? 192 : 64);
    const uint8_t *end = trellis + (size_t)kt1 * (size_t)n_tiles * tile_bytes; /* of this call */
    _Alignas(64) int16_t q[GEMV_MAX_ROWS][128];
    int32_t xpair[GEMV_MAX_ROWS][8]; /* per row pair: (q[r], q[r + 1]) as one int32 */
    float scale[GEMV_MAX_ROWS], sx[GEMV_MAX_ROWS];
    int32_t centre[GEMV_MAX_ROWS];
    memset(acc, 0, sizeof(float) * (size_t)m * n);
    for (int i = 0; i < m; i++)
        sx[i] = scale[i] = 0.0f;
    for (int kt = kt0, block = -1; kt < kt1; kt++) {
        if (kt / 8 != block) {
            block = kt / 8;
            for (int i = 0; i < m; i++)
                scale[i] = gemv_fast_quantise(xh + (size_t)i * (size_t)x_stride + 128 * block, q[i]);
        }
        for (int i = 0; i < m; i++) {
            const int16_t *x = q[i] + 16 * (kt % 8);
            int qsum = 0;
            for (int r = 0; r < 16; r++)
                qsum += x[r];
            sx[i] = fmaf(scale[i], (float)qsum, sx[i]);
            centre[i] = GEMV_FAST_CENTRE * qsum;
            for (int p = 0; p < 8; p++) {
                int r = 2 * (p & 3) + 8 * (p >> 2);
                xpair[i][p] = (int32_t)((uint32_t)(uint16_t)x[r] | (uint32_t)(uint16_t)x[r + 1] << 16);
            }
        }
        const uint8_t *tile = trellis + (size_t)kt * (size_t)n_tiles * tile_bytes;
        for (int nt = 0; nt < n_tiles; nt++, tile += tile_bytes) {
            if (tile + PREFETCH_BYTES < end) /* every line: a tile is at most 4 lines */
                for (size_t off = 0; off < tile_bytes; off += 64)
                    _mm_prefetch((const char *)tile + PREFETCH_BYTES + off, _MM_HINT_T0);
            __m512i t0, t1, t2 = _mm512_setzero_si512(), t3 = _mm512_setzero_si512();
            if (!wide) {
                t0 = full1 ? _mm512_loadu_si512(tile) : _mm512_maskz_loadu_epi8(tail, tile);
                t1 = full2 ? _mm512_maskz_loadu_epi8(tail, tile + 64) : _mm512_setzero_si512();
            } else {
                t0 = _mm512_loadu_si512(tile);
                t1 = _mm512_loadu_si512(tile + 64);
                t2 = full1 ? _mm512_loadu_si512(tile + 128)
                           : _mm512_maskz_loadu_epi8(tail, tile + 128);
                t3 = full2 ? _mm512_maskz_loadu_epi8(tail, tile + 192) : _mm512_setzero_si512();
            }
            __m512i a[GEMV_MAX_ROWS], sums[8]; /* per activation row, per row pair */
            for (int i = 0; i < m; i++)
                a[i] = _mm512_set1_epi32(-centre[i]);
            if (shared) {
#pragma GCC unroll 4
                for (int p = 0; p < 4; p++) {
                    __m512i raw = gather(tab->gidx[p], t0, t1, t2, t3, wide);
                    sums[p] = state_sums(pick(tab->gshift[p], raw));
                    sums[p + 4] = state_sums(pick(tab->gshift[p + 4], raw));
                }
            } else {
#pragma GCC unroll 8
                for (int p = 0; p < 8; p++)
                    sums[p] = state_sums(pick(tab->shift[p], gather(tab->idx[p], t0, t1, t2, t3, wide)));
            }
            for (int i = 0; i < m; i++)
#pragma GCC unroll 8
                for (int p = 0; p < 8; p++)
                    a[i] = _mm512_dpwssd_epi32(a[i], sums[p], _mm512_set1_epi32(xpair[i][p]));
            for (int i = 0; i < m; i++) {
                float *y = acc + (size_t)i * n + 16 * (size_t)nt;
                __m512 v = _mm512_cvtepi32_ps(a[i]);
                _mm512_storeu_ps(y, _mm512_fmadd_ps(_mm512_set1_ps(scale[i]), v, _mm512_loadu_ps(y)));
            }
        }
    }
    for (int i = 0; i < m; i++) {
        float offset = GEMV_FAST_C0P * sx[i], cols[16];
        for (size_t col = 0; col < n; col += 16) {
            float *y = acc + (size_t)i * n + col;
            for (int k = 0; k < 16; k++)
                cols[lane_col(k)] = fmaf(GEMV_MUL1_KINV, y[k], offset);
            memcpy(y, cols, sizeof cols);
        }
    }
}

void gemv_tiles_avx512_fast(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1,
                            const float *xh, int x_stride, int m, float *acc)
{
    pthread_once(&tables_once, build_tables);
    const int wide = gemv_tile_bytes(k2) > 128; /* K >= 4.5: the tile takes four zmm */
    /* gathers shared where the windows fit (K <= 4 here; K 5 and 6 would fit too, but a fourth
     * instantiation moved the one-row loop's code and cost 12 % at one row on Zen 4) */
    const int shared = !wide && tables[k2].shared;
    switch (m) {
#define CASE(M)                                                                                \
    case M:                                                                                    \
        if (wide)                                                                         \
            tiles_m(trellis, n_tiles, k2, kt0, kt1, xh, x_stride, M, acc, 1, 0);               \
        else if (shared)                                                                       \
            tiles_m(trellis, n_tiles, k2, kt0, kt1, xh, x_stride, M, acc, 0, 1);               \
        else                                                                                   \
            tiles_m(trellis, n_tiles, k2, kt0, kt1, xh, x_stride, M, acc, 0, 0);               \
        break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    }
}
