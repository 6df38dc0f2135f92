/* gemv_avx512.c: the AVX-512 tile kernel (F/BW/VL + VBMI + VNNI; see gemv_kern.h).
 *
 * One zmm holds one tile row: lane c is the weight at (row r, column c), so every weight meets
 * its input x[r] as a broadcast and each (activation row, tile) keeps one accumulator. Per row:
 *   vpermi2b   gather, for every lane, the three trellis bytes holding its 16-bit window
 *              (index tables per rate and row, built once; the tile sits in two zmm)
 *   vpsrlvd + vpandd   align the window: the 16-bit state
 *   vpmulld + vpdpbusd state * 0x83DCD12D, then the byte sum of the product
 *   cvt + fma  the exact fp32 value, then the Veltkamp split rounds it to fp16 precision
 *   fma per activation row
 * Tiles wider than 128 bytes (K >= 5) take four zmm and two gathers blended on index bit 7. */
#include <immintrin.h>
#include <pthread.h>
#include <string.h>

#include "gemv_kern.h"

typedef struct {
    uint8_t idx[16][64];  /* per tile row: byte index of each lane's [S2, S1, S0, S0] */
    int32_t shift[16][16]; /* per tile row: right shift that aligns each lane's window */
} row_tables;

static row_tables tables[17]; /* by k2 */
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

static void build_tables(void)
{
    int pos_of[256];
    for (int t = 0; t < 256; t++)
        pos_of[gemv_tc_row(t) * 16 + gemv_tc_col(t)] = t;
    for (int k2 = 2; k2 <= 16; k2++) {
        int ring_bits = 128 * k2, ring_bytes = 16 * k2;
        for (int r = 0; r < 16; r++)
            for (int c = 0; c < 16; c++) {
                int t = pos_of[r * 16 + c];
                int start = (gemv_state_end(k2, t) - 16 + ring_bits) % ring_bits;
                int q = start / 8;
                uint8_t *lane = &tables[k2].idx[r][4 * c];
                lane[0] = (uint8_t)gemv_stream_byte((q + 2) % ring_bytes);
                lane[1] = (uint8_t)gemv_stream_byte((q + 1) % ring_bytes);
                lane[2] = (uint8_t)gemv_stream_byte(q);
                lane[3] = lane[2];
                tables[k2].shift[r][c] = 8 - start % 8;
            }
    }
}

typedef struct {
    __m512i mask16, mult, ones8;
    __m512 kinv, c0, split;
} consts;

static inline __attribute__((always_inline)) __m512 weights_of(__m512i raw, __m512i shift,
                                                               const consts *k)
{
    __m512i state = _mm512_and_si512(_mm512_srlv_epi32(raw, shift), k->mask16);
    __m512i prod = _mm512_mullo_epi32(state, k->mult);
    __m512i byte_sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), prod, k->ones8);
    __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(byte_sum), k->kinv, k->c0);
    __m512 c = _mm512_mul_ps(v, k->split);
    return _mm512_sub_ps(c, _mm512_sub_ps(c, v));
}

/* Rows of `m` activations (m a compile-time constant after inlining). */
static inline __attribute__((always_inline)) void
tiles_m(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1, const float *xh,
        int x_stride, const int m, float *acc)
{
    const row_tables *tab = &tables[k2];
    const consts k = {
        _mm512_set1_epi32(0xFFFF), _mm512_set1_epi32((int)GEMV_MUL1_MULT), _mm512_set1_epi8(1),
        _mm512_set1_ps(GEMV_MUL1_KINV), _mm512_set1_ps(GEMV_MUL1_C0), _mm512_set1_ps(GEMV_SPLIT_FP16)};
    const size_t tile_bytes = (size_t)gemv_tile_bytes(k2);
    const size_t n = 16 * (size_t)n_tiles;
    const int wide = tile_bytes > 128;
    /* Bytes of the last zmm load that lie inside the tile (masked: never reads past it). */
    const __mmask64 tail = tile_bytes % 64 ? ((__mmask64)1 << (tile_bytes % 64)) - 1 : ~(__mmask64)0;
    for (int kt = kt0; kt < kt1; kt++) {
        const uint8_t *tile = trellis + (size_t)kt * (size_t)n_tiles * tile_bytes;
        const float *x = xh + 16 * kt;
        for (int nt = 0; nt < n_tiles; nt++, tile += tile_bytes) {
            __m512i t0, t1, t2 = _mm512_setzero_si512(), t3 = _mm512_setzero_si512();
            if (!wide) {
                t0 = tile_bytes >= 64 ? _mm512_loadu_si512(tile) : _mm512_maskz_loadu_epi8(tail, tile);
                t1 = tile_bytes > 64 ? _mm512_maskz_loadu_epi8(tail, tile + 64) : _mm512_setzero_si512();
            } else {
                t0 = _mm512_loadu_si512(tile);
                t1 = _mm512_loadu_si512(tile + 64);
                t2 = tile_bytes >= 192 ? _mm512_loadu_si512(tile + 128)
                                       : _mm512_maskz_loadu_epi8(tail, tile + 128);
                t3 = tile_bytes > 192 ? _mm512_maskz_loadu_epi8(tail, tile + 192)
                                      : _mm512_setzero_si512();
            }
            __m512 a[GEMV_MAX_ROWS];
            for (int i = 0; i < m; i++)
                a[i] = kt == kt0 ? _mm512_setzero_ps()
                                 : _mm512_loadu_ps(acc + (size_t)i * n + 16 * (size_t)nt);
            for (int r = 0; r < 16; r++) {
                __m512i idx = _mm512_loadu_si512(tab->idx[r]);
                __m512i raw = _mm512_permutex2var_epi8(t0, idx, t1);
                if (wide) {
                    __m512i hi = _mm512_permutex2var_epi8(t2, idx, t3);
                    raw = _mm512_mask_blend_epi8(_mm512_movepi8_mask(idx), raw, hi);
                }
                __m512 w = weights_of(raw, _mm512_loadu_si512(tab->shift[r]), &k);
                for (int i = 0; i < m; i++)
                    a[i] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[(size_t)i * x_stride + r]), a[i]);
            }
            for (int i = 0; i < m; i++)
                _mm512_storeu_ps(acc + (size_t)i * n + 16 * (size_t)nt, a[i]);
        }
    }
}

void gemv_tiles_avx512(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1,
                       const float *xh, int x_stride, int m, float *acc)
{
    pthread_once(&tables_once, build_tables);
    if (kt0 >= kt1) {
        memset(acc, 0, sizeof(float) * (size_t)m * 16 * (size_t)n_tiles);
        return;
    }
    switch (m) {
#define CASE(M) \
    case M: tiles_m(trellis, n_tiles, k2, kt0, kt1, xh, x_stride, M, acc); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    }
}
