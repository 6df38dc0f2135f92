/* gemv_avx2_fast.c: the fast AVX2 tile kernel (unrounded codebook, int16 inputs; gemv_fast.h).
 *
 * A ymm holds 16 consecutive trellis states t = 16h .. 16h + 15 (two lane groups of the exact
 * kernel, one per 128-bit half) as 16-bit lanes. Each 32-bit lane holds a pair (t, t + 1): the
 * same column, rows r and r + 1, so vpmaddwd against the pair's two int16 inputs gives that
 * column's partial sum with no float in between. Per chunk of 16 weights:
 *   vpshufb          4 stream bytes per pair, most significant first, from the chunk's window
 *   vpsrlvd/vpsllvd  state t in the low half, state t + 1 in the high half, then vpblendw: the two
 *                    16-bit states, with no mask (the blend drops what the shifts left over)
 *   3 x vpmul*w      state * 0x83DCD12D as two 16-bit halves
 *   2 x vpmaddubsw   the byte sum s (0..1020) in the 16-bit lane
 *   vpmaddwd         per pair: q[r] s + q[r + 1] s'  (int32)
 * The eight int32 accumulators of a tile (column c in lanes 0, 1, 4, 5; c + 8 in 2, 3, 6, 7) fold
 * with vphaddd into the tile's 16 column sums, kept in the order POS below until the end.
 *
 * Where the time goes (one thread, m = 1, K = 3, measured by ablation on a Zen 3 EPYC): the
 * chunk's vector arithmetic above, about 5 cycles per chunk; the FP pipes are the limit (dropping
 * the three multiplies and a vpmaddubsw is 1.5x, trading vpmaddubsw or vpblendw for and/shift/add
 * sequences is slower). The trellis read is not (a pool in DRAM runs as fast as one in L2). So
 * around the arithmetic the kernel does as little as it can:
 *   - the tile is read in place: a window inside the tile is one 16-byte load; the one or two
 *     windows that cross the ring's ends (the first and last chunk for K >= 2) are picked from
 *     the tile's last and first 16 bytes with two vpshufb and a vpor (fill_wrap). The earlier
 *     per-tile copy into a padded ring (8 loads and stores per tile for K = 3, and reads that
 *     missed store forwarding) cost 1.3x;
 *   - the 16 chunks are unrolled, so which ones wrap is known at compile time (`edges`);
 *   - the shuffle and shift controls repeat every 4 chunks (chunk_ctl) and are loaded once per
 *     call instead of 3 loads per chunk.
 * Integer sums are exact (|sum| < 2^28), so their order is free; the float operations and their
 * order are those of gemv_fast.h, and the output equals the scalar fast kernel's bit for bit. */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gemv_fast.h"

typedef struct {
    int16_t off[16][2];   /* per chunk: 16 + the tile byte where its low, high half starts */
    uint8_t ctrl[16][32]; /* per chunk: vpshufb control, per pair [S3, S2, S1, S0] */
    int32_t shr[16][8];   /* per chunk and pair: right shift that leaves state t in bits 0..15 */
    int32_t shl[16][8];   /* ... left shift that puts state t + 1 in bits 16..31 */
    uint8_t wrap[16];     /* per chunk: a window reaches across the ring's ends */
    int16_t src[16][2];   /* wrap chunks, per half: tile byte where source A starts (B: 0) */
    uint8_t wctrl[16][2][32]; /* wrap chunks: the vpshufb controls of A and B (0x80: other) */
    int one_window;       /* every chunk's two halves read the same 16 bytes (K <= 5) */
    int edges;            /* only the first and the last chunk wrap (K >= 2) */
} fast_tables;

static fast_tables tables[17]; /* by k2 */
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

/* Column of accumulator position p in a tile's 16 floats. */
static const int POS[16] = {0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15};

static int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

/* 4-aligned byte where the window of lane group g starts (relative to the tile). */
static int group_base(int k2, int g)
{
    return 4 * floor_div(floor_div(gemv_state_end(k2, 8 * g) - 16, 8), 4);
}

/* Fill chunk h's half `half` from a window at `base`; returns 0 if a pair's bytes fall outside. */
static int fill_half(fast_tables *tab, int k2, int h, int half, int base)
{
    for (int j = 0; j < 4; j++) {
        int k = 4 * half + j, t = 16 * h + 2 * k;
        int start = gemv_state_end(k2, t) - 16;
        int qabs = floor_div(start, 8), p0 = start - 8 * qabs, q = qabs - base;
        if (q < 0 || q + 3 > 15)
            return 0;
        uint8_t *lane = &tab->ctrl[h][4 * k];
        for (int b = 0; b < 4; b++) /* lane byte b (little-endian) = stream byte q + 3 - b */
            lane[b] = (uint8_t)gemv_stream_byte(q + 3 - b);
        tab->shr[h][k] = 16 - p0;
        tab->shl[h][k] = p0 + gemv_state_end(k2, t + 1) - gemv_state_end(k2, t);
    }
    return 1;
}

/* Wrap chunk h: each half's window bytes as picks from two 16-byte tile pieces A and B. A half
 * whose window crosses a ring end takes A = the tile's last 16 bytes and B = its first 16 (every
 * byte of such a window is in one of them); a half inside the tile takes A = its window. */
static void fill_wrap(fast_tables *tab, int k2, int h)
{
    const int tb = gemv_tile_bytes(k2);
    for (int half = 0; half < 2; half++) {
        int p = tab->off[h][half] - 16; /* window start in the tile, may be < 0 or > tb - 16 */
        int across = p < 0 || p + 16 > tb;
        tab->src[h][half] = (int16_t)(across ? tb - 16 : p);
        for (int i = 0; i < 16; i++) {
            int c = tab->ctrl[h][16 * half + i], r = ((p + c) % tb + tb) % tb;
            uint8_t *a = &tab->wctrl[h][0][16 * half + i], *b = &tab->wctrl[h][1][16 * half + i];
            if (!across) {
                *a = (uint8_t)c, *b = 0x80;
            } else if (r >= tb - 16) {
                *a = (uint8_t)(r - (tb - 16)), *b = 0x80;
            } else { /* r < 16: the window is 16 bytes long and crosses an end */
                *a = 0x80, *b = (uint8_t)r;
            }
        }
    }
}

static void build_tables(void)
{
    for (int k2 = 2; k2 <= 16; k2++) {
        fast_tables *tab = &tables[k2];
        tab->one_window = 1;
        for (int h = 0; h < 16; h++) {
            int lo = group_base(k2, 2 * h), hi = group_base(k2, 2 * h + 1);
            fill_half(tab, k2, h, 0, lo);
            tab->off[h][0] = (int16_t)(16 + lo);
            if (tab->one_window && fill_half(tab, k2, h, 1, lo)) {
                tab->off[h][1] = (int16_t)(16 + lo);
            } else {
                tab->one_window = 0;
                fill_half(tab, k2, h, 1, hi);
                tab->off[h][1] = (int16_t)(16 + hi);
            }
        }
        if (!tab->one_window) /* one layout for every chunk: each half at its own window */
            for (int h = 0; h < 16; h++) {
                int hi = group_base(k2, 2 * h + 1);
                fill_half(tab, k2, h, 1, hi);
                tab->off[h][1] = (int16_t)(16 + hi);
            }
        for (int h = 0; h < 16; h++) {
            int first = tab->off[h][0] < tab->off[h][1] ? tab->off[h][0] : tab->off[h][1];
            int last = tab->off[h][0] > tab->off[h][1] ? tab->off[h][0] : tab->off[h][1];
            tab->wrap[h] = first < 16 || last + 16 > 16 + gemv_tile_bytes(k2);
            if (tab->wrap[h])
                fill_wrap(tab, k2, h);
        }
        tab->edges = 1;
        for (int h = 0; h < 16; h++)
            tab->edges &= tab->wrap[h] == (h == 0 || h == 15);
        for (int h = 4; h < 16; h++) /* chunk_ctl: the kernel uses chunk h mod 4's controls */
            if (memcmp(tab->ctrl[h], tab->ctrl[h - 4], sizeof tab->ctrl[h]) ||
                memcmp(tab->shr[h], tab->shr[h - 4], sizeof tab->shr[h]) ||
                memcmp(tab->shl[h], tab->shl[h - 4], sizeof tab->shl[h])) {
                fprintf(stderr, "gemv_avx2_fast: chunk %d's controls differ from chunk %d's (k2 %d)\n",
                        h, h - 4, k2);
                abort();
            }
    }
}

/* Chunk h's shuffle and shifts are chunk h mod 4's: chunk h + 1 starts k2 bytes (8 k2 bits) after
 * chunk h, so every chunk's pairs sit alike in a window that starts 4-aligned, which chunks h and
 * h + 4 (4 k2 bytes apart) share; build_tables checks it. Held in registers (or spilled once)
 * for a whole call, not loaded per chunk. */
typedef struct {
    __m256i ctrl[4], shr[4], shl[4];
} chunk_ctl;

/* The byte sums of chunk h (16 states) as 16-bit lanes, from the tile in place: a window inside
 * the tile is one load (`tile_m16` + its offset), one across its ends is picked from two pieces
 * (fill_wrap) with two vpshufb and an or; the picked bytes are those of the ring either way. */
static inline __attribute__((always_inline)) __m256i chunk_sums(const uint8_t *tile,
                                                                const fast_tables *tab,
                                                                const chunk_ctl *ctl, int h,
                                                                const int one, const int edges)
{
    const __m256i mlo = _mm256_set1_epi16((short)(GEMV_MUL1_MULT & 0xFFFF));
    const __m256i mhi = _mm256_set1_epi16((short)(GEMV_MUL1_MULT >> 16));
    const __m256i ones8 = _mm256_set1_epi8(1);
    __m256i raw;
    if (edges ? h == 0 || h == 15 : tab->wrap[h]) {
        __m256i a = _mm256_loadu2_m128i((const __m128i *)(tile + tab->src[h][1]),
                                        (const __m128i *)(tile + tab->src[h][0]));
        __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)tile));
        raw = _mm256_or_si256(
            _mm256_shuffle_epi8(a, _mm256_loadu_si256((const __m256i *)tab->wctrl[h][0])),
            _mm256_shuffle_epi8(b, _mm256_loadu_si256((const __m256i *)tab->wctrl[h][1])));
    } else {
        const uint8_t *tile_m16 = tile - 16;
        __m256i win = one ? _mm256_broadcastsi128_si256(
                                _mm_loadu_si128((const __m128i *)(tile_m16 + tab->off[h][0])))
                          : _mm256_loadu2_m128i((const __m128i *)(tile_m16 + tab->off[h][1]),
                                                (const __m128i *)(tile_m16 + tab->off[h][0]));
        raw = _mm256_shuffle_epi8(win, ctl->ctrl[h % 4]);
    }
    __m256i even = _mm256_srlv_epi32(raw, ctl->shr[h % 4]);
    __m256i odd = _mm256_sllv_epi32(raw, ctl->shl[h % 4]);
    __m256i state = _mm256_blend_epi16(even, odd, 0xAA);
    __m256i lo = _mm256_mullo_epi16(state, mlo);
    __m256i hi = _mm256_add_epi16(_mm256_mulhi_epu16(state, mlo), _mm256_mullo_epi16(state, mhi));
    return _mm256_add_epi16(_mm256_maddubs_epi16(lo, ones8), _mm256_maddubs_epi16(hi, ones8));
}

static inline __attribute__((always_inline)) void
tiles_m(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1, const float *xh,
        int x_stride, const int m, float *acc, const int one, const int edges)
{
    const fast_tables *tab = &tables[k2];
    chunk_ctl ctl;
    for (int h = 0; h < 4; h++) {
        ctl.ctrl[h] = _mm256_loadu_si256((const __m256i *)tab->ctrl[h]);
        ctl.shr[h] = _mm256_loadu_si256((const __m256i *)tab->shr[h]);
        ctl.shl[h] = _mm256_loadu_si256((const __m256i *)tab->shl[h]);
    }
    const size_t tile_bytes = (size_t)gemv_tile_bytes(k2), n = 16 * (size_t)n_tiles;
    _Alignas(32) int16_t q[GEMV_MAX_ROWS][128];
    _Alignas(32) int16_t xq[GEMV_MAX_ROWS][2][16]; /* inputs in lane order of even, odd chunks */
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
            for (int t = 0; t < 32; t++)
                xq[i][t / 16][t % 16] = x[gemv_tc_row(t)];
        }
        const uint8_t *tile = trellis + (size_t)kt * (size_t)n_tiles * tile_bytes;
        for (int nt = 0; nt < n_tiles; nt++, tile += tile_bytes) {
            __m256i h[GEMV_MAX_ROWS][4];
#pragma GCC unroll 4
            for (int quarter = 0; quarter < 4; quarter++) {
                __m256i s0 = chunk_sums(tile, tab, &ctl, 4 * quarter, one, edges);
                __m256i s1 = chunk_sums(tile, tab, &ctl, 4 * quarter + 1, one, edges);
                __m256i s2 = chunk_sums(tile, tab, &ctl, 4 * quarter + 2, one, edges);
                __m256i s3 = chunk_sums(tile, tab, &ctl, 4 * quarter + 3, one, edges);
                for (int i = 0; i < m; i++) {
                    __m256i xe = _mm256_load_si256((const __m256i *)xq[i][0]);
                    __m256i xo = _mm256_load_si256((const __m256i *)xq[i][1]);
                    __m256i a0 = _mm256_add_epi32(_mm256_madd_epi16(s0, xe), _mm256_madd_epi16(s1, xo));
                    __m256i a1 = _mm256_add_epi32(_mm256_madd_epi16(s2, xe), _mm256_madd_epi16(s3, xo));
                    h[i][quarter] = _mm256_hadd_epi32(a0, a1); /* columns 2q, 2q+8, 2q+1, 2q+9 */
                }
            }
            for (int i = 0; i < m; i++) {
                const __m256i c = _mm256_set1_epi32(centre[i]);
                const __m256 sc = _mm256_set1_ps(scale[i]);
                __m256i v0 = _mm256_add_epi32(_mm256_permute2x128_si256(h[i][0], h[i][1], 0x20),
                                              _mm256_permute2x128_si256(h[i][0], h[i][1], 0x31));
                __m256i v1 = _mm256_add_epi32(_mm256_permute2x128_si256(h[i][2], h[i][3], 0x20),
                                              _mm256_permute2x128_si256(h[i][2], h[i][3], 0x31));
                float *y = acc + (size_t)i * n + 16 * (size_t)nt;
                _mm256_storeu_ps(y, _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(_mm256_sub_epi32(v0, c)),
                                                    _mm256_loadu_ps(y)));
                _mm256_storeu_ps(y + 8, _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(_mm256_sub_epi32(v1, c)),
                                                        _mm256_loadu_ps(y + 8)));
            }
        }
    }
    for (int i = 0; i < m; i++) {
        float offset = GEMV_FAST_C0P * sx[i], tile[16];
        for (size_t col = 0; col < n; col += 16) {
            float *y = acc + (size_t)i * n + col;
            for (int p = 0; p < 16; p++)
                tile[POS[p]] = fmaf(GEMV_MUL1_KINV, y[p], offset);
            memcpy(y, tile, sizeof tile);
        }
    }
}

void gemv_tiles_avx2_fast(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1,
                          const float *xh, int x_stride, int m, float *acc)
{
    pthread_once(&tables_once, build_tables);
    /* the layouts that occur: K <= 1.5 (any chunk may wrap), 2 <= K <= 5, K >= 5.5 */
    const int one = tables[k2].one_window, edges = tables[k2].edges;
    switch (m) {
#define CASE(M)                                                                                \
    case M:                                                                                    \
        if (!edges)                                                                            \
            tiles_m(trellis, n_tiles, k2, kt0, kt1, xh, x_stride, M, acc, one, 0);             \
        else if (one)                                                                          \
            tiles_m(trellis, n_tiles, k2, kt0, kt1, xh, x_stride, M, acc, 1, 1);               \
        else                                                                                   \
            tiles_m(trellis, n_tiles, k2, kt0, kt1, xh, x_stride, M, acc, 0, 1);               \
        break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    }
}
