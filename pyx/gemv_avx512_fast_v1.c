/* gemv_avx512_fast_v1.c: the previous fast AVX-512 tile kernel (as of 2026-12-04, 10131c8), kept
 * only so that the current one (gemv_avx512_fast.c) can be compared with it on the same host in the
 * same process (`_gemv.tiles(..., previous=True)`, `bench/micro_gemv.py --ab`); the lane never
 * dispatches to it. Both equal the scalar fast kernel bit for bit (tests/test_gemv_fast.py).
 * (F/BW/VL + VBMI + VNNI; unrounded codebook, int16 inputs; gemv_fast.h.)
 *
 * A zmm holds one row pair (r, r + 1) of a tile: 32-bit lane k is column POS[k], its low 16 bits
 * the state at row r, its high 16 bits the state at row r + 1. So one vpdpwssd against the pair's
 * int16 inputs (broadcast) adds q[r] s + q[r+1] s' to each column, and a tile keeps one int32
 * accumulator per activation row. Per row pair (32 weights):
 *   vpermi2b       each 64-bit lane (columns c and c + 8: states t, t+1, t+4, t+5) gets the 8
 *                  stream bytes that hold its four windows, most significant first (the tile sits
 *                  in two zmm; tiles wider than 128 bytes take two gathers blended on bit 7)
 *   vpmultishiftqb each 16-bit lane picks its state's two bytes at any bit offset: the states,
 *                  with no shift or mask
 *   3 x vpmul*w, 2 x vpmaddubsw   the byte sums s, as in the AVX2 fast kernel
 *   vpdpwssd       per activation row
 * The accumulator starts at -510 sum(q) (the centre, gemv_fast.h), so a tile ends with one
 * convert and one fma per activation row; whether the tile takes two or four zmm (K >= 4.5) is
 * a compile-time case, not a test per row pair.
 *
 * Where the time goes (one thread, m = 1, K = 3, kernel alone, best of interleaved runs on a
 * 2-core Zen 4 EPYC VM, 5.83 GB/s of trellis, 2.1 ns per row pair): the ten vector operations
 * per row pair above; the trellis read is not (a pool in DRAM runs as fast as one in L3).
 * Ablations (results wrong, timing only): dropping the two vpmaddubsw is 1.54x, the three
 * multiplies 1.34x, the gather and vpmultishiftqb 1.20x, all three 2.4x. Trading a vpmaddubsw
 * for and + shift (or vpshufb) + add is 0.92x (0.88x): on Zen 4 the count of 512-bit
 * operations is the limit, and on Intel's server cores (uops.info's tables; not measured here)
 * every multiply above issues on port 0 alone (six per row pair), so neither a cheaper byte sum
 * nor 32-bit products (vpmulld: two port-0 uops there) cuts the per-weight cost on both. */
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
    }
}

/* Row pair p's byte sums s (0..1020) as 16-bit lanes, from the tile in two (or four) zmm. */
static inline __attribute__((always_inline)) __m512i pair_sums(const fast_tables *tab, int p,
                                                               __m512i t0, __m512i t1, __m512i t2,
                                                               __m512i t3, const int wide)
{
    const __m512i mlo = _mm512_set1_epi16((short)(GEMV_MUL1_MULT & 0xFFFF));
    const __m512i mhi = _mm512_set1_epi16((short)(GEMV_MUL1_MULT >> 16));
    const __m512i ones8 = _mm512_set1_epi8(1);
    __m512i idx = _mm512_load_si512(tab->idx[p]);
    __m512i raw = _mm512_permutex2var_epi8(t0, idx, t1);
    if (wide)
        raw = _mm512_mask_blend_epi8(_mm512_movepi8_mask(idx), raw,
                                     _mm512_permutex2var_epi8(t2, idx, t3));
    __m512i state = _mm512_multishift_epi64_epi8(_mm512_load_si512(tab->shift[p]), raw);
    __m512i lo = _mm512_mullo_epi16(state, mlo);
    __m512i hi = _mm512_add_epi16(_mm512_mulhi_epu16(state, mlo), _mm512_mullo_epi16(state, mhi));
    return _mm512_add_epi16(_mm512_maddubs_epi16(lo, ones8), _mm512_maddubs_epi16(hi, ones8));
}

static inline __attribute__((always_inline)) void
tiles_m(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1, const float *xh,
        int x_stride, const int m, float *acc, const int wide)
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
            __m512i a[GEMV_MAX_ROWS];
            for (int i = 0; i < m; i++)
                a[i] = _mm512_set1_epi32(-centre[i]);
#pragma GCC unroll 8
            for (int p = 0; p < 8; p++) {
                __m512i s = pair_sums(tab, p, t0, t1, t2, t3, wide);
                for (int i = 0; i < m; i++)
                    a[i] = _mm512_dpwssd_epi32(a[i], s, _mm512_set1_epi32(xpair[i][p]));
            }
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

void gemv_tiles_avx512_fast_v1(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1,
                               const float *xh, int x_stride, int m, float *acc)
{
    pthread_once(&tables_once, build_tables);
    const int wide = gemv_tile_bytes(k2) > 128; /* K >= 4.5: the tile takes four zmm */
    switch (m) {
#define CASE(M)                                                                                \
    case M:                                                                                    \
        if (wide)                                                                              \
            tiles_m(trellis, n_tiles, k2, kt0, kt1, xh, x_stride, M, acc, 1);                  \
        else                                                                                   \
            tiles_m(trellis, n_tiles, k2, kt0, kt1, xh, x_stride, M, acc, 0);                  \
        break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    }
}
