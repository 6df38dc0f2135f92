/* gemv_avx512fp16.c: the AVX-512 FP16 tile kernel (F/BW/VL + VBMI/VBMI2 + FP16: Sapphire Rapids
 * and later; see gemv_kern.h).
 *
 * One zmm holds two tile rows as 32 16-bit lanes (row r in lanes 0-15, row r+1 in 16-31, lane
 * order = column order), so everything up to the fp16 weight is done 32 at a time:
 *   2 x vpermi2b  each lane's window bytes: [S1, S0] and [x, S2] (the tile sits in two zmm)
 *   vpshldvw      (S0 S1 : S2 x) << offset, upper half: the 16-bit state, no mask needed
 *   3 x vpmul*w   state * 0x83DCD12D as 16-bit halves lo, hi
 *   2 x vpmaddubsw + 2 x vpaddw   byte sum + 0x6400 = the fp16 bits of 1024 + byte sum
 *   vfmadd213ph   (1024 + s) * KINV + KBIAS with one fp16 rounding: the GPU's hfma, bit for bit
 * then each half widens to fp32 (vcvtph2ps from memory) and meets its input x[r] (x[r+1]) as a
 * broadcast.
 * Tiles wider than 128 bytes (K >= 5) take four zmm and gathers blended on index bit 7. */
#include <immintrin.h>
#include <pthread.h>
#include <string.h>

#include "gemv_kern.h"

typedef struct {
    uint8_t hi[8][64];     /* per row pair: byte index of each lane's [S1, S0] */
    uint8_t lo[8][64];     /* per row pair: byte index of each lane's [S2, S2] */
    uint16_t shift[8][32]; /* per row pair: bit offset of each lane's window inside S0 */
} pair_tables;

static pair_tables tables[17]; /* by k2 */
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

static void build_tables(void)
{
    int pos_of[256];
    for (int t = 0; t < 256; t++)
        pos_of[gemv_tc_row(t) * 16 + gemv_tc_col(t)] = t;
    for (int k2 = 2; k2 <= 16; k2++) {
        int ring_bits = 128 * k2, ring_bytes = 16 * k2;
        for (int p = 0; p < 8; p++)
            for (int lane = 0; lane < 32; lane++) {
                int t = pos_of[(2 * p + lane / 16) * 16 + lane % 16];
                int start = (gemv_state_end(k2, t) - 16 + ring_bits) % ring_bits;
                int q = start / 8;
                uint8_t s2 = (uint8_t)gemv_stream_byte((q + 2) % ring_bytes);
                tables[k2].hi[p][2 * lane] = (uint8_t)gemv_stream_byte((q + 1) % ring_bytes);
                tables[k2].hi[p][2 * lane + 1] = (uint8_t)gemv_stream_byte(q);
                tables[k2].lo[p][2 * lane] = s2;
                tables[k2].lo[p][2 * lane + 1] = s2;
                tables[k2].shift[p][lane] = (uint16_t)(start % 8);
            }
    }
}

static inline __attribute__((always_inline)) __m512i gather(__m512i t0, __m512i t1, __m512i t2,
                                                            __m512i t3, __m512i idx, int wide)
{
    __m512i v = _mm512_permutex2var_epi8(t0, idx, t1);
    if (wide)
        v = _mm512_mask_blend_epi8(_mm512_movepi8_mask(idx), v, _mm512_permutex2var_epi8(t2, idx, t3));
    return v;
}

/* fp16 weights of tile rows 2p, 2p+1 (row 2p in the low 16 lanes). */
static inline __attribute__((always_inline)) __m512h pair_weights(__m512i t0, __m512i t1,
                                                                  __m512i t2, __m512i t3,
                                                                  const pair_tables *tab, int p,
                                                                  int wide)
{
    const __m512i mult_lo = _mm512_set1_epi16((short)(GEMV_MUL1_MULT & 0xFFFF));
    const __m512i mult_hi = _mm512_set1_epi16((short)(GEMV_MUL1_MULT >> 16));
    const __m512i ones8 = _mm512_set1_epi8(1), one1024 = _mm512_set1_epi16(0x6400);
    const __m512h kinv = _mm512_castsi512_ph(_mm512_set1_epi16(0x1EEE));
    const __m512h kbias = _mm512_castsi512_ph(_mm512_set1_epi16((short)0xC931));
    __m512i hi = gather(t0, t1, t2, t3, _mm512_loadu_si512(tab->hi[p]), wide);
    __m512i lo = gather(t0, t1, t2, t3, _mm512_loadu_si512(tab->lo[p]), wide);
    __m512i state = _mm512_shldv_epi16(hi, lo, _mm512_loadu_si512(tab->shift[p]));
    __m512i prod_lo = _mm512_mullo_epi16(state, mult_lo);
    __m512i prod_hi = _mm512_add_epi16(_mm512_mulhi_epu16(state, mult_lo),
                                       _mm512_mullo_epi16(state, mult_hi));
    __m512i sum = _mm512_add_epi16(_mm512_maddubs_epi16(prod_lo, ones8),
                                   _mm512_maddubs_epi16(prod_hi, ones8));
    __m512h h = _mm512_castsi512_ph(_mm512_add_epi16(sum, one1024));
    return _mm512_fmadd_ph(h, kinv, kbias);
}

static inline __attribute__((always_inline)) void
tiles_m(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1, const float *xh,
        int x_stride, const int m, float *acc)
{
    const pair_tables *tab = &tables[k2];
    const size_t tile_bytes = (size_t)gemv_tile_bytes(k2);
    const size_t n = 16 * (size_t)n_tiles;
    const int wide = tile_bytes > 128;
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
            /* Up to 4 activation rows get a second accumulator chain (odd tile rows), so the
             * FMA latency does not bound the loop; more rows already give enough chains. */
            const int split = m <= 4;
            __attribute__((aligned(64))) uint16_t wbuf[32];
            __m512 a[GEMV_MAX_ROWS], b[GEMV_MAX_ROWS];
            for (int i = 0; i < m; i++) {
                a[i] = kt == kt0 ? _mm512_setzero_ps()
                                 : _mm512_loadu_ps(acc + (size_t)i * n + 16 * (size_t)nt);
                b[i] = _mm512_setzero_ps();
            }
            for (int p = 0; p < 8; p++) {
                /* Widen through memory: vcvtph2ps from a register takes a port-5 shuffle
                 * (plus the vextracti64x4 for the upper half), from memory the load port does
                 * it; port 5 also runs the vpermi2b gathers. The compiler barrier keeps the
                 * store and the two loads (forwarded from the store buffer). 3.5 % faster at
                 * one activation row, same at more (CI-size VM, same CPU model as the H200
                 * host, 20 interleaved pairs pinned to one core). */
                __m512h w = pair_weights(t0, t1, t2, t3, tab, p, wide);
                _mm512_store_si512(wbuf, _mm512_castph_si512(w));
                __asm__ volatile("" ::: "memory");
                __m512 w0 = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)wbuf));
                __m512 w1 = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)wbuf + 1));
                for (int i = 0; i < m; i++) {
                    const float *xi = x + (size_t)i * x_stride + 2 * p;
                    a[i] = _mm512_fmadd_ps(w0, _mm512_set1_ps(xi[0]), a[i]);
                    if (split)
                        b[i] = _mm512_fmadd_ps(w1, _mm512_set1_ps(xi[1]), b[i]);
                    else
                        a[i] = _mm512_fmadd_ps(w1, _mm512_set1_ps(xi[1]), a[i]);
                }
            }
            for (int i = 0; i < m; i++)
                _mm512_storeu_ps(acc + (size_t)i * n + 16 * (size_t)nt,
                                 split ? _mm512_add_ps(a[i], b[i]) : a[i]);
        }
    }
}

void gemv_tiles_avx512fp16(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1,
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
