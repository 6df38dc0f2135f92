// Multi-buffer SHA-256 on AVX-512 (F + BW): lane l of every vector belongs to message l. See
// sha256mb.h. Written from FIPS 180-4: the round constants, initial value, message schedule,
// round function and padding are the standard's sections 4.2.2, 5.3.3, 6.2.2 and 5.1.1.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "sha256mb.h"

#define LANES 16
#define BLOCK 64

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static const uint32_t H256[8] = {
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
};

#define ROR(x, n) _mm512_ror_epi32((x), (n))
#define SHR(x, n) _mm512_srli_epi32((x), (n))
#define ADD(a, b) _mm512_add_epi32((a), (b))
#define XOR3(a, b, c) _mm512_ternarylogic_epi32((a), (b), (c), 0x96)  // a ^ b ^ c
#define CH(e, f, g) _mm512_ternarylogic_epi32((e), (f), (g), 0xca)    // (e & f) ^ (~e & g)
#define MAJ(a, b, c) _mm512_ternarylogic_epi32((a), (b), (c), 0xe8)   // majority

// 16 x 16 transpose of 32-bit words: row l (lane l's 64-byte block) becomes column l, so that
// vector t holds word t of every lane's block.
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // each 128-bit quarter now holds a transposed 4 x 4 tile; move the tiles into place
    for (int i = 0; i < 4; i++) {
        __m512i ab_lo = _mm512_shuffle_i32x4(r[i], r[4 + i], 0x88);
        __m512i ab_hi = _mm512_shuffle_i32x4(r[i], r[4 + i], 0xdd);
        __m512i cd_lo = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0x88);
        __m512i cd_hi = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0xdd);
        t[i] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0x88);
        t[8 + i] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0xdd);
        t[4 + i] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0x88);
        t[12 + i] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0xdd);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

// Runs nblocks compression steps on every lane: lane l reads block b at ptr[l] + 64 b. Only the
// lanes in mask take the result; the others must still point at nblocks readable blocks.
static void compress(__m512i state[8], const uint8_t *const ptr[LANES], __mmask16 mask,
                     uint64_t nblocks) {
    // bytes of each 32-bit word reversed: the message words are big-endian
    const __m512i bswap = _mm512_set4_epi32(0x0c0d0e0f, 0x08090a0b, 0x04050607, 0x00010203);
    for (uint64_t blk = 0; blk < nblocks; blk++) {
        __m512i w[16];
        for (int l = 0; l < LANES; l++) w[l] = _mm512_loadu_si512(ptr[l] + blk * BLOCK);
        transpose16(w);
        for (int i = 0; i < 16; i++) w[i] = _mm512_shuffle_epi8(w[i], bswap);
        __m512i a = state[0], b = state[1], c = state[2], d = state[3];
        __m512i e = state[4], f = state[5], g = state[6], h = state[7];
        _Pragma("GCC unroll 64") for (int t = 0; t < 64; t++) {
            __m512i wt;
            if (t < 16) {
                wt = w[t];
            } else {
                __m512i w15 = w[(t - 15) & 15], w2 = w[(t - 2) & 15];
                __m512i s0 = XOR3(ROR(w15, 7), ROR(w15, 18), SHR(w15, 3));
                __m512i s1 = XOR3(ROR(w2, 17), ROR(w2, 19), SHR(w2, 10));
                wt = ADD(ADD(w[t & 15], s0), ADD(w[(t - 7) & 15], s1));
                w[t & 15] = wt;
            }
            __m512i t1 = ADD(ADD(h, XOR3(ROR(e, 6), ROR(e, 11), ROR(e, 25))),
                             ADD(CH(e, f, g), ADD(_mm512_set1_epi32((int)K256[t]), wt)));
            __m512i t2 = ADD(XOR3(ROR(a, 2), ROR(a, 13), ROR(a, 22)), MAJ(a, b, c));
            h = g;
            g = f;
            f = e;
            e = ADD(d, t1);
            d = c;
            c = b;
            b = a;
            a = ADD(t1, t2);
        }
        state[0] = _mm512_mask_add_epi32(state[0], mask, state[0], a);
        state[1] = _mm512_mask_add_epi32(state[1], mask, state[1], b);
        state[2] = _mm512_mask_add_epi32(state[2], mask, state[2], c);
        state[3] = _mm512_mask_add_epi32(state[3], mask, state[3], d);
        state[4] = _mm512_mask_add_epi32(state[4], mask, state[4], e);
        state[5] = _mm512_mask_add_epi32(state[5], mask, state[5], f);
        state[6] = _mm512_mask_add_epi32(state[6], mask, state[6], g);
        state[7] = _mm512_mask_add_epi32(state[7], mask, state[7], h);
    }
}

// Hashes k <= 16 messages, one per lane.
static void hash_group(const uint8_t *const *data, const uint64_t *lengths, int k,
                       uint8_t *digests) {
    __m512i state[8];
    for (int i = 0; i < 8; i++) state[i] = _mm512_set1_epi32((int)H256[i]);

    const uint8_t *ptr[LANES];
    uint64_t left[LANES];  // whole blocks still to hash from the message itself
    int tail_blocks[LANES];
    // the last partial block, the 0x80 byte, zeros and the bit length: 1 or 2 blocks
    uint8_t tail[LANES][2 * BLOCK];
    memset(tail, 0, sizeof tail);
    for (int l = 0; l < LANES; l++) {
        if (l >= k) {
            ptr[l] = tail[0];
            left[l] = 0;
            tail_blocks[l] = 0;
            continue;
        }
        uint64_t len = lengths[l];
        uint64_t rest = len % BLOCK;
        ptr[l] = data[l];
        left[l] = len / BLOCK;
        if (rest) memcpy(tail[l], data[l] + (len - rest), rest);
        tail[l][rest] = 0x80;
        tail_blocks[l] = rest < BLOCK - 8 ? 1 : 2;
        uint64_t bits = len << 3;  // the length in bits, modulo 2^64
        uint8_t *end = tail[l] + tail_blocks[l] * BLOCK;
        for (int i = 1; i <= 8; i++) end[-i] = (uint8_t)(bits >> (8 * (i - 1)));
    }

    // the messages' own whole blocks, in runs during which every busy lane has blocks left
    for (;;) {
        __mmask16 mask = 0;
        uint64_t run = UINT64_MAX;
        int busy = -1;
        for (int l = 0; l < LANES; l++) {
            if (!left[l]) continue;
            mask |= (__mmask16)(1u << l);
            if (left[l] < run) run = left[l];
            busy = l;
        }
        if (!mask) break;
        const uint8_t *p[LANES];
        for (int l = 0; l < LANES; l++) p[l] = left[l] ? ptr[l] : ptr[busy];  // idle: any busy lane
        compress(state, p, mask, run);
        for (int l = 0; l < LANES; l++) {
            if (!left[l]) continue;
            ptr[l] += run * BLOCK;
            left[l] -= run;
        }
    }
    // the padding blocks
    for (int b = 0; b < 2; b++) {
        __mmask16 mask = 0;
        const uint8_t *p[LANES];
        for (int l = 0; l < LANES; l++) {
            p[l] = tail[l] + b * BLOCK;
            if (tail_blocks[l] > b) mask |= (__mmask16)(1u << l);
        }
        if (mask) compress(state, p, mask, 1);
    }

    uint32_t words[8][LANES];
    for (int i = 0; i < 8; i++) _mm512_storeu_si512(words[i], state[i]);
    for (int l = 0; l < k; l++) {
        uint8_t *out = digests + (size_t)l * G53_SHA256_DIGEST_BYTES;
        for (int i = 0; i < 8; i++) {
            uint32_t v = words[i][l];
            out[4 * i] = (uint8_t)(v >> 24);
            out[4 * i + 1] = (uint8_t)(v >> 16);
            out[4 * i + 2] = (uint8_t)(v >> 8);
            out[4 * i + 3] = (uint8_t)v;
        }
    }
}

void g53_sha256_many_avx512(const uint8_t *const *data, const uint64_t *lengths, int n,
                            uint8_t *digests) {
    for (int first = 0; first < n; first += LANES) {
        int k = n - first < LANES ? n - first : LANES;
        hash_group(data + first, lengths + first, k, digests + (size_t)first * 32);
    }
}
