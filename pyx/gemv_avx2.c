/* gemv_avx2.c: the AVX2 + FMA + F16C tile kernel (see gemv_kern.h).
 *
 * A ymm holds 8 consecutive trellis states (one tensor-core lane group: rows r0, r0+1, r0+8,
 * r0+9 of two columns), whose windows span at most 12 stream bytes: one 16-byte load, broadcast
 * to both halves, and a vpshufb places each lane's three bytes. Then, as in the AVX-512 kernel:
 * shift + mask -> state, vpmulld, byte sum (vpmaddubsw + vpmaddwd), exact fp32 value, Veltkamp
 * rounding to fp16 precision. The tile's 256 weights go to a small buffer; each activation row
 * then meets them with inputs permuted to the lane order, and 8 accumulators fold into the tile's
 * 16 columns. The tile is copied between a 16-byte tail and head copy so that the windows that
 * wrap around the ring read plain memory. */
#include <immintrin.h>
#include <pthread.h>
#include <string.h>

#include "gemv_kern.h"

typedef struct {
    int16_t offset[32];     /* per lane group: first byte of its 16-byte window in the padded tile */
    uint8_t ctrl[32][32];   /* per lane group: vpshufb control, lanes [S2, S1, S0, zero] */
    int32_t shift[32][8];   /* per lane group: right shift that aligns each window */
} group_tables;

static group_tables tables[17]; /* by k2 */
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

static int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

static void build_tables(void)
{
    for (int k2 = 2; k2 <= 16; k2++)
        for (int g = 0; g < 32; g++) {
            /* unbiased window starts: the first group's reach back across the ring start */
            int first = floor_div(gemv_state_end(k2, 8 * g) - 16, 8);
            int base = 4 * floor_div(first, 4);
            tables[k2].offset[g] = (int16_t)(16 + base);
            for (int j = 0; j < 8; j++) {
                int start = gemv_state_end(k2, 8 * g + j) - 16;
                int q = floor_div(start, 8) - base; /* 0..13: inside the 16-byte window */
                uint8_t *lane = &tables[k2].ctrl[g][4 * j];
                lane[0] = (uint8_t)gemv_stream_byte(q + 2);
                lane[1] = (uint8_t)gemv_stream_byte(q + 1);
                lane[2] = (uint8_t)gemv_stream_byte(q);
                lane[3] = 0x80; /* vpshufb writes zero */
                tables[k2].shift[g][j] = 8 - (start - 8 * floor_div(start, 8));
            }
        }
}

static inline __attribute__((always_inline)) void decode_tile(const uint8_t *padded,
                                                              const group_tables *tab, float *w)
{
    const __m256i mask16 = _mm256_set1_epi32(0xFFFF), mult = _mm256_set1_epi32((int)GEMV_MUL1_MULT);
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    const __m256 kinv = _mm256_set1_ps(GEMV_MUL1_KINV), c0 = _mm256_set1_ps(GEMV_MUL1_C0);
    const __m256 split = _mm256_set1_ps(GEMV_SPLIT_FP16);
    for (int g = 0; g < 32; g++) {
        __m256i win = _mm256_broadcastsi128_si256(
            _mm_loadu_si128((const __m128i *)(padded + tab->offset[g])));
        __m256i raw = _mm256_shuffle_epi8(win, _mm256_loadu_si256((const __m256i *)tab->ctrl[g]));
        __m256i state = _mm256_and_si256(
            _mm256_srlv_epi32(raw, _mm256_loadu_si256((const __m256i *)tab->shift[g])), mask16);
        __m256i prod = _mm256_mullo_epi32(state, mult);
        __m256i byte_sum = _mm256_madd_epi16(_mm256_maddubs_epi16(prod, ones8), ones16);
        __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(byte_sum), kinv, c0);
        __m256 c = _mm256_mul_ps(v, split);
        _mm256_storeu_ps(w + 8 * g, _mm256_sub_ps(c, _mm256_sub_ps(c, v)));
    }
}

/* xp[p]: the 16 inputs of a tile row in lane order of groups g with g % 4 == p. */
static inline void permute_inputs(const float *x, float xp[4][8])
{
    for (int p = 0; p < 4; p++) {
        int r0 = 2 * p;
        const int rows[4] = {r0, r0 + 1, r0 + 8, r0 + 9};
        for (int j = 0; j < 8; j++)
            xp[p][j] = x[rows[j % 4]];
    }
}

/* y[0..16) += the tile's products with one activation row (lane order -> columns). */
static inline __attribute__((always_inline)) void accumulate(const float *w, const float xp[4][8],
                                                             float *y)
{
    __m256 a[8];
    const __m256 x0 = _mm256_loadu_ps(xp[0]), x1 = _mm256_loadu_ps(xp[1]);
    const __m256 x2 = _mm256_loadu_ps(xp[2]), x3 = _mm256_loadu_ps(xp[3]);
    for (int c = 0; c < 8; c++) { /* groups 4c..4c+3 hold columns c (lanes 0-3) and c+8 (4-7) */
        __m256 s = _mm256_mul_ps(_mm256_loadu_ps(w + 32 * c), x0);
        s = _mm256_fmadd_ps(_mm256_loadu_ps(w + 32 * c + 8), x1, s);
        s = _mm256_fmadd_ps(_mm256_loadu_ps(w + 32 * c + 16), x2, s);
        a[c] = _mm256_fmadd_ps(_mm256_loadu_ps(w + 32 * c + 24), x3, s);
    }
    /* hadd pairs twice: lo halves sum lanes 0-3 (column c), hi halves lanes 4-7 (column c+8) */
    __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 lo = _mm256_hadd_ps(h01, h23); /* columns 0-3 | 8-11 */
    __m256 hi = _mm256_hadd_ps(h45, h67); /* columns 4-7 | 12-15 */
    __m256 first = _mm256_permute2f128_ps(lo, hi, 0x20), second = _mm256_permute2f128_ps(lo, hi, 0x31);
    _mm256_storeu_ps(y, _mm256_add_ps(_mm256_loadu_ps(y), first));
    _mm256_storeu_ps(y + 8, _mm256_add_ps(_mm256_loadu_ps(y + 8), second));
}

void gemv_tiles_avx2(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1,
                     const float *xh, int x_stride, int m, float *acc)
{
    pthread_once(&tables_once, build_tables);
    const group_tables *tab = &tables[k2];
    const size_t tile_bytes = (size_t)gemv_tile_bytes(k2), n = 16 * (size_t)n_tiles;
    _Alignas(64) uint8_t padded[16 + 256 + 16];
    _Alignas(64) float w[256];
    float xp[GEMV_MAX_ROWS][4][8];
    memset(acc, 0, sizeof(float) * (size_t)m * n);
    for (int kt = kt0; kt < kt1; kt++) {
        for (int i = 0; i < m; i++)
            permute_inputs(xh + (size_t)i * x_stride + 16 * kt, xp[i]);
        const uint8_t *tile = trellis + (size_t)kt * (size_t)n_tiles * tile_bytes;
        for (int nt = 0; nt < n_tiles; nt++, tile += tile_bytes) {
            /* 16-byte pieces only: the tile is a multiple of 16 bytes, nothing is read past it */
            _mm_store_si128((__m128i *)padded,
                            _mm_loadu_si128((const __m128i *)(tile + tile_bytes - 16)));
            for (size_t b = 0; b < tile_bytes; b += 16)
                _mm_storeu_si128((__m128i *)(padded + 16 + b), _mm_loadu_si128((const __m128i *)(tile + b)));
            _mm_storeu_si128((__m128i *)(padded + 16 + tile_bytes), _mm_loadu_si128((const __m128i *)tile));
            decode_tile(padded, tab, w);
            for (int i = 0; i < m; i++)
                accumulate(w, (const float(*)[8])xp[i], acc + (size_t)i * n + 16 * (size_t)nt);
        }
    }
}
