/* Fused CPU kernels for the hot codecs: one pass over memory per encode and per decode.
 *
 * Each function produces exactly the bytes of its torch specification in reference.py
 * (same rounding, same counter-based noise, same bit layout), bucket by bucket: a bucket's
 * values stay in L1 between the statistics pass and the quantise-and-pack pass. Compiled at
 * first use by native.py with -ffp-contract=off, so no multiply-add is fused into an FMA and
 * every float operation rounds as torch's do.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_BUCKET 65536

static inline uint32_t mix(uint32_t i, uint32_t key) {
    uint32_t x = i * 0x9E3779B1u + key;
    x ^= x >> 16;
    x *= 0x85EBCA6Bu;
    x ^= x >> 13;
    x *= 0xC2B2AE35u;
    x ^= x >> 16;
    return x;
}

static inline float uniform(int64_t i, uint32_t key) {
    return (float)(mix((uint32_t)i, key) >> 8) * (1.0f / 16777216.0f);
}

#define INLINE static inline __attribute__((always_inline))

/* Pack `len` levels (len a multiple of 8) of `bits` bits into `out` (the layout of pack_bits). */
INLINE void pack_width(const uint8_t *lv, int64_t len, uint8_t *out, const int bits) {
    if (bits == 8) {
        memcpy(out, lv, (size_t)len);
    } else if (8 % bits == 0) {
        const int per = 8 / bits;
        for (int64_t k = 0; k < len / per; k++) {
            uint8_t b = 0;
            for (int j = 0; j < per; j++) b |= (uint8_t)(lv[k * per + j] << (bits * j));
            out[k] = b;
        }
    } else {
        for (int64_t g = 0; g < len / 8; g++) {
            uint64_t w = 0;
            for (int j = 0; j < 8; j++) w |= (uint64_t)lv[g * 8 + j] << (bits * j);
            for (int j = 0; j < bits; j++) out[g * bits + j] = (uint8_t)(w >> (8 * j));
        }
    }
}

/* Inverse of pack_width for `len` levels (len a multiple of 8). */
INLINE void unpack_width(const uint8_t *in, int64_t len, uint8_t *lv, const int bits) {
    const uint8_t mask = (uint8_t)((1u << bits) - 1u);
    if (bits == 8) {
        memcpy(lv, in, (size_t)len);
    } else if (8 % bits == 0) {
        const int per = 8 / bits;
        for (int64_t k = 0; k < len / per; k++) {
            const uint8_t b = in[k];
            for (int j = 0; j < per; j++) lv[k * per + j] = (uint8_t)((b >> (bits * j)) & mask);
        }
    } else {
        for (int64_t g = 0; g < len / 8; g++) {
            uint64_t w = 0;
            for (int j = 0; j < bits; j++) w |= (uint64_t)in[g * bits + j] << (8 * j);
            for (int j = 0; j < 8; j++) lv[g * 8 + j] = (uint8_t)((w >> (bits * j)) & mask);
        }
    }
}

/* The width as a compile-time constant in each case, so the loops above unroll and vectorise. */
#define BY_WIDTH(call, ...)                                                                   \
    switch (bits) {                                                                           \
    case 1: call(__VA_ARGS__, 1); break;                                                      \
    case 2: call(__VA_ARGS__, 2); break;                                                      \
    case 3: call(__VA_ARGS__, 3); break;                                                      \
    case 4: call(__VA_ARGS__, 4); break;                                                      \
    case 5: call(__VA_ARGS__, 5); break;                                                      \
    case 6: call(__VA_ARGS__, 6); break;                                                      \
    case 7: call(__VA_ARGS__, 7); break;                                                      \
    default: call(__VA_ARGS__, 8); break;                                                     \
    }

static void pack(const uint8_t *lv, int64_t len, int bits, uint8_t *out) { BY_WIDTH(pack_width, lv, len, out) }

static void unpack(const uint8_t *in, int64_t len, int bits, uint8_t *lv) { BY_WIDTH(unpack_width, in, len, lv) }

/* NaN anywhere makes both NaN (as torch.aminmax does), so the stats carry the non-finite flag. */
static void min_max(const float *x, int64_t len, float *lo_out, float *hi_out) {
    float lo = x[0], hi = x[0];
    int nan = 0;
#pragma omp simd reduction(min : lo) reduction(max : hi) reduction(| : nan)
    for (int64_t i = 0; i < len; i++) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
        nan |= x[i] != x[i];
    }
    *lo_out = nan ? NAN : lo;
    *hi_out = nan ? NAN : hi;
}

static inline int64_t round_up8(int64_t n) { return (n + 7) & ~(int64_t)7; }

static inline int64_t packed_offset(int64_t start, int bits) { return bits == 8 ? start : start / 8 * bits; }

/* stochastic != 0: floor(v + u) with u = uniform(index, key); else round half to even. */
void gz_maxmin_encode(const float *x, int64_t n, int bits, int64_t bucket, int stochastic, uint32_t key,
                      uint8_t *packed, float *stats) {
    const int64_t nb = (n + bucket - 1) / bucket;
    const float q = (float)((1 << bits) - 1);
    for (int64_t b = 0; b < nb; b++) {
        uint8_t lv[MAX_BUCKET];
        const int64_t start = b * bucket;
        const int64_t len = n - start < bucket ? n - start : bucket;
        const float *xb = x + start;
        float lo, hi;
        min_max(xb, len, &lo, &hi);
        const float span = hi - lo;
        /* a finite range beyond fp32 (both signs near the maximum): work on halves */
        const int big = isinf(span) && isfinite(lo) && isfinite(hi);
        float scale = span / q;
        if (big) {
            scale = hi / q - lo / q;
            scale = scale > FLT_MAX ? FLT_MAX : scale;
        }
        const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        if (big) {
            const float half_lo = lo * 0.5f, inv2 = inv * 2.0f;
            for (int64_t i = 0; i < len; i++) {
                const float v = (xb[i] * 0.5f - half_lo) * inv2;
                float f = stochastic ? floorf(v + uniform(start + i, key)) : nearbyintf(v);
                f = f < 0.0f ? 0.0f : f;
                f = f > q ? q : f;
                lv[i] = (uint8_t)(int32_t)f;
            }
        } else if (stochastic) {
            for (int64_t i = 0; i < len; i++) {
                float f = floorf((xb[i] - lo) * inv + uniform(start + i, key));
                f = f < 0.0f ? 0.0f : f;
                f = f > q ? q : f;
                lv[i] = (uint8_t)(int32_t)f;
            }
        } else {
            for (int64_t i = 0; i < len; i++) {
                float f = nearbyintf((xb[i] - lo) * inv);
                f = f < 0.0f ? 0.0f : f;
                f = f > q ? q : f;
                lv[i] = (uint8_t)(int32_t)f;
            }
        }
        const int64_t padded = bits == 8 ? len : round_up8(len);
        memset(lv + len, 0, (size_t)(padded - len));
        pack(lv, padded, bits, packed + packed_offset(start, bits));
        stats[2 * b] = lo;
        stats[2 * b + 1] = scale;
    }
}

/* The decoders write out[i] = value, or out[i] += value with accumulate != 0 (summing ranks). */
void gz_maxmin_decode(const uint8_t *packed, const float *stats, int64_t n, int bits, int64_t bucket, float *out,
                      int accumulate) {
    const int64_t nb = (n + bucket - 1) / bucket;
    for (int64_t b = 0; b < nb; b++) {
        uint8_t lv[MAX_BUCKET];
        const int64_t start = b * bucket;
        const int64_t len = n - start < bucket ? n - start : bucket;
        unpack(packed + packed_offset(start, bits), bits == 8 ? len : round_up8(len), bits, lv);
        const float lo = stats[2 * b], scale = stats[2 * b + 1];
        float *ob = out + start;
        /* lo + level * scale cannot overflow unless |lo| + q * scale nears the fp32 maximum */
        const float q = (float)((1 << bits) - 1);
        if (isfinite(lo) && isfinite(scale) && !(fabsf(lo) + q * scale < 0x1p126f)) {
            for (int64_t i = 0; i < len; i++) {
                float v = lo + (float)lv[i] * scale;
                if (isinf(v)) { /* a range beyond fp32: halves, saturated */
                    v = 2.0f * (lo * 0.5f + (float)lv[i] * (scale * 0.5f));
                    v = v > FLT_MAX ? FLT_MAX : (v < -FLT_MAX ? -FLT_MAX : v);
                }
                ob[i] = accumulate ? ob[i] + v : v;
            }
        } else if (accumulate) {
            for (int64_t i = 0; i < len; i++) ob[i] += lo + (float)lv[i] * scale;
        } else {
            for (int64_t i = 0; i < len; i++) ob[i] = lo + (float)lv[i] * scale;
        }
    }
}

void gz_qsgd_encode(const float *x, int64_t n, int bits, int64_t bucket, uint32_t key, uint8_t *packed, float *norms) {
    const int64_t nb = (n + bucket - 1) / bucket;
    const int s = (1 << (bits - 1)) - 1;
    const float sf = (float)s;
    for (int64_t b = 0; b < nb; b++) {
        uint8_t lv[MAX_BUCKET];
        const int64_t start = b * bucket;
        const int64_t len = n - start < bucket ? n - start : bucket;
        const float *xb = x + start;
        /* fp64 sum of squares, exact products that cannot overflow or underflow, rounded once;
         * a finite norm beyond fp32 is stored as its maximum, s / norm is capped at it too */
        double total = 0.0;
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < len; i++) total += (double)xb[i] * (double)xb[i];
        const double nd = sqrt(total);
        const float norm = nd > FLT_MAX && !isinf(nd) ? FLT_MAX : (float)nd;
        float inv = norm > 0.0f ? sf / norm : 0.0f;
        inv = inv > FLT_MAX ? FLT_MAX : inv;
        for (int64_t i = 0; i < len; i++) {
            float f = floorf(fabsf(xb[i]) * inv + uniform(start + i, key));
            f = f < 0.0f ? 0.0f : f;
            f = f > sf ? sf : f;
            lv[i] = (uint8_t)((int32_t)f | ((xb[i] < 0.0f) << (bits - 1)));
        }
        const int64_t padded = bits == 8 ? len : round_up8(len);
        memset(lv + len, 0, (size_t)(padded - len));
        pack(lv, padded, bits, packed + packed_offset(start, bits));
        norms[b] = norm;
    }
}

void gz_qsgd_decode(const uint8_t *packed, const float *norms, int64_t n, int bits, int64_t bucket, float *out,
                    int accumulate) {
    const int64_t nb = (n + bucket - 1) / bucket;
    const int s = (1 << (bits - 1)) - 1;
    for (int64_t b = 0; b < nb; b++) {
        uint8_t lv[MAX_BUCKET];
        const int64_t start = b * bucket;
        const int64_t len = n - start < bucket ? n - start : bucket;
        unpack(packed + packed_offset(start, bits), bits == 8 ? len : round_up8(len), bits, lv);
        const float step = norms[b] / (float)s;
        float *ob = out + start;
        /* s * (norm / s) may round above the largest fp32: clamp where the norm is finite */
        const float top = isfinite(norms[b]) ? FLT_MAX : INFINITY;
        for (int64_t i = 0; i < len; i++) {
            const float sign = 1.0f - 2.0f * (float)(lv[i] >> (bits - 1));
            float v = ((float)(lv[i] & s) * sign) * step;
            v = v > top ? top : (v < -top ? -top : v);
            ob[i] = accumulate ? ob[i] + v : v;
        }
    }
}

/* out[i] = uniform(start + i, key) for i < n: the draws of rng.counter_uniform, bit for bit. */
void gz_uniform(int64_t start, int64_t n, uint32_t key, float *out) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = uniform(start + i, key);
}

void gz_sign_encode(const float *x, int64_t n, uint8_t *packed) {
    const int64_t full = n / 8;
    for (int64_t k = 0; k < full; k++) {
        uint8_t b = 0;
        for (int j = 0; j < 8; j++) b |= (uint8_t)((x[8 * k + j] >= 0.0f) << j);
        packed[k] = b;
    }
    if (n % 8) {
        uint8_t b = 0;
        for (int64_t j = 0; j < n % 8; j++) b |= (uint8_t)((x[8 * full + j] >= 0.0f) << j);
        packed[full] = b;
    }
}

/* Signum's encode: each momentum m <- fmaf(alpha, g, m * beta) (torch's mul, then its add with
 * alpha, which rounds once), written back where `update` (a finite step), and one bit a value,
 * set where the new momentum >= 0 (NaN: clear), as gz_sign_encode packs them. */
void gz_signum_encode(const float *g, float *m, int64_t n, float beta, float alpha, int update, uint8_t *packed) {
    for (int64_t k = 0; k < (n + 7) / 8; k++) {
        const int64_t len = n - 8 * k < 8 ? n - 8 * k : 8;
        uint8_t b = 0;
        for (int64_t j = 0; j < len; j++) {
            const int64_t i = 8 * k + j;
            const float v = fmaf(alpha, g[i], m[i] * beta);
            if (update) m[i] = v;
            b |= (uint8_t)((v >= 0.0f) << j);
        }
        packed[k] = b;
    }
}

/* scale: a pointer to one float, or NULL for plain ±1. Eight values per byte; the branches on
 * scale and accumulate are loop-invariant, so the compiler unswitches them. */
void gz_sign_decode(const uint8_t *packed, int64_t n, const float *scale, float *out, int accumulate) {
    const float s = scale ? *scale : 1.0f;
    const int scaled = scale != NULL;
    for (int64_t k = 0; k < (n + 7) / 8; k++) {
        const uint8_t b = packed[k];
        const int64_t m = n - 8 * k < 8 ? n - 8 * k : 8;
        float *o = out + 8 * k;
        if (m == 8) {
            for (int j = 0; j < 8; j++) {
                float v = (float)((b >> j) & 1) * 2.0f - 1.0f;
                v = scaled ? v * s : v;
                o[j] = accumulate ? o[j] + v : v;
            }
        } else {
            for (int64_t j = 0; j < m; j++) {
                float v = (float)((b >> j) & 1) * 2.0f - 1.0f;
                v = scaled ? v * s : v;
                o[j] = accumulate ? o[j] + v : v;
            }
        }
    }
}

/* Exact top-k by magnitude, as a radix select on the bit patterns of |x| (for non-negative
 * floats, the order of the bits as unsigned integers is the order of the values; NaN ranks
 * highest). Pass 1 histograms the top 16 bits, pass 2 the low 16 bits within the bin that holds
 * the k-th largest, pass 3 writes the indices, ascending: every key above the threshold and the
 * first of those equal to it (lowest indices first), k in all. `hist` is 65536 scratch counters. */
static inline uint32_t magnitude_key(float v) {
    /* |v|'s bits, every NaN the one key above +inf (a 16-bit NaN converted to fp32 need not keep
       its payload bits alike everywhere: ties among NaNs then go to the lowest index too) */
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    u &= 0x7FFFFFFFu;
    return u < 0x7F800001u ? u : 0x7F800001u;
}

static uint32_t select_bin(const int64_t *hist, int64_t k, int64_t *above) {
    int64_t acc = 0;
    uint32_t b = 65535;
    for (;; b--) {
        if (acc + hist[b] >= k || b == 0) break;
        acc += hist[b];
    }
    *above = acc;
    return b;
}

void gz_topk(const float *x, int64_t n, int64_t k, int64_t *idx, int64_t *hist) {
    if (k <= 0) return;
    memset(hist, 0, 65536 * sizeof(int64_t));
    for (int64_t i = 0; i < n; i++) hist[magnitude_key(x[i]) >> 16]++;
    int64_t above_hi;
    const uint32_t hi = select_bin(hist, k, &above_hi);
    memset(hist, 0, 65536 * sizeof(int64_t));
    for (int64_t i = 0; i < n; i++) {
        const uint32_t key = magnitude_key(x[i]);
        if ((key >> 16) == hi) hist[key & 0xFFFFu]++;
    }
    int64_t above_lo;
    const uint32_t lo = select_bin(hist, k - above_hi, &above_lo);
    const uint32_t threshold = (hi << 16) | lo;
    int64_t ties = k - above_hi - above_lo, out = 0;
    for (int64_t i = 0; i < n && out < k; i++) {
        const uint32_t key = magnitude_key(x[i]);
        if (key > threshold || (key == threshold && ties-- > 0)) idx[out++] = i;
    }
}

/* ---------------------------------------------------------------- FP8 and microscaling (MX)
 * The bytes of reference.fp8_encode / mx_encode, block by block. Elements are converted with
 * integer arithmetic on the fp32 bits, rounding to nearest even exactly as torch's float8 casts
 * do: below the format's smallest normal, adding 2**k (whose fp32 ulp is the format's subnormal
 * step) rounds in the FPU; above it, the bits are rebiased and rounded by adding half an ulp
 * minus one plus the lowest kept mantissa bit. Block maxima are taken on the magnitude bits (for
 * non-negative floats, integer order is value order). A format is (MBITS mantissa bits, exponent
 * bias EBIAS, sign at bit SIGN_AT, largest finite value TOP): e4m3 (3, 7, 7, 448), e5m2
 * (2, 15, 7, 57344), e2m1 (1, 1, 3, 6). With AVX-512 the rows run 16 values at a time with
 * masked tails (the same operations, so the same bits); the portable loops are the other path
 * (built with -DGZ_PORTABLE to test them on a machine with AVX-512). */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && !defined(GZ_PORTABLE)
#include <immintrin.h>
#define GZ_AVX512 1
#endif

static inline uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* code of v (|v| <= TOP; NaN gives an unspecified code) */
INLINE uint32_t to_mini(float v, const int mbits, const int ebias, const int sign_at) {
    const uint32_t u = f2u(v), a = u & 0x7FFFFFFFu;
    const int shift = 23 - mbits;
    const uint32_t denorm = (uint32_t)(127 - ebias + shift + 1) << 23;
    const uint32_t sub = f2u(u2f(a) + u2f(denorm)) - denorm;
    const uint32_t nor = (a - ((uint32_t)(127 - ebias) << 23) + ((1u << (shift - 1)) - 1u) + ((a >> shift) & 1u)) >> shift;
    const uint32_t mag = a < ((uint32_t)(128 - ebias) << 23) ? sub : nor;
    return (mag & ((1u << sign_at) - 1u)) | ((u >> 31) << sign_at);
}

/* fp32 value of a code, exactly and without subnormal arithmetic (slow on some CPUs): a normal
 * code's bits rebiased, a subnormal code's mantissa times the format's subnormal step
 * 2**(1 - EBIAS - MBITS). SPECIAL: 1 for e4m3fn (magnitude 0x7F is NaN), 2 for e5m2 (0x7C is
 * inf, above it NaN), 0 for none (e2m1). */
INLINE float from_mini(uint32_t c, const int mbits, const int ebias, const int sign_at, const int special) {
    const uint32_t mag = c & ((1u << sign_at) - 1u);
    const uint32_t normal = (mag << (23 - mbits)) + ((uint32_t)(127 - ebias) << 23);
    const float sub = (float)(int32_t)(mag & ((1u << mbits) - 1u)) * u2f((uint32_t)(128 - ebias - mbits) << 23);
    uint32_t bits = (mag >> mbits) ? normal : f2u(sub);
    if (special == 1) bits = mag == 0x7Fu ? 0x7FC00000u : bits;
    if (special == 2) bits = mag >= 0x7Cu ? (mag == 0x7Cu ? 0x7F800000u : 0x7FC00000u) : bits;
    return u2f(bits | (((c >> sign_at) & 1u) << 31));
}

INLINE float clamp_to(float v, const float top) {
    v = v > top ? top : v; /* NaN stays NaN */
    return v < -top ? -top : v;
}

#ifdef GZ_AVX512
static inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u); }

#define SET1(v) _mm512_set1_epi32((int)(v))

INLINE __m512i v_to_mini(__m512 v, const int mbits, const int ebias, const int sign_at) {
    const int shift = 23 - mbits;
    const uint32_t denorm = (uint32_t)(127 - ebias + shift + 1) << 23;
    const __m512i u = _mm512_castps_si512(v);
    const __m512i a = _mm512_and_si512(u, SET1(0x7FFFFFFFu));
    const __m512i sub = _mm512_sub_epi32(
        _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(SET1(denorm)))), SET1(denorm));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, shift), SET1(1));
    const uint32_t bias = ((1u << (shift - 1)) - 1u) - ((uint32_t)(127 - ebias) << 23);
    const __m512i nor = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, SET1(bias)), odd), shift);
    const __mmask16 small = _mm512_cmplt_epu32_mask(a, SET1((uint32_t)(128 - ebias) << 23));
    /* bits below SIGN_AT from the magnitude, the rest from u >> (31 - SIGN_AT): the sign at
     * SIGN_AT, zeros above it (one ternary-logic select) */
    return _mm512_ternarylogic_epi32(SET1((1u << sign_at) - 1u), _mm512_mask_blend_epi32(small, nor, sub),
                                     _mm512_srli_epi32(u, 31 - sign_at), 0xCA);
}

/* clamp_to lane by lane: MINPS(a, b) is a < b ? a : b and MAXPS(a, b) a > b ? a : b, so with
 * the bound first a NaN lane keeps its NaN, as in the scalar version */
INLINE __m512 v_clamp(__m512 v, __m512 top, __m512 neg_top) {
    return _mm512_max_ps(neg_top, _mm512_min_ps(top, v));
}

INLINE __m512 v_from_mini(__m512i c, const int mbits, const int ebias, const int sign_at, const int special) {
    const __m512i mag = _mm512_and_si512(c, SET1((1u << sign_at) - 1u));
    const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 23 - mbits), SET1((uint32_t)(127 - ebias) << 23));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(mag, SET1((1u << mbits) - 1u))),
                                     _mm512_castsi512_ps(SET1((uint32_t)(128 - ebias - mbits) << 23)));
    const __mmask16 is_normal = _mm512_test_epi32_mask(mag, SET1(((1u << sign_at) - 1u) & ~((1u << mbits) - 1u)));
    __m512i bits = _mm512_mask_blend_epi32(is_normal, _mm512_castps_si512(sub), normal);
    if (special == 1) bits = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(mag, SET1(0x7F)), bits, SET1(0x7FC00000u));
    if (special == 2) {
        bits = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(mag, SET1(0x7C)), bits, SET1(0x7F800000u));
        bits = _mm512_mask_blend_epi32(_mm512_cmpgt_epi32_mask(mag, SET1(0x7C)), bits, SET1(0x7FC00000u));
    }
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(c, SET1(1u << sign_at)), 31 - sign_at);
    return _mm512_castsi512_ps(_mm512_or_si512(bits, sign));
}

#endif

static inline uint32_t max_magnitude(const float *x, int64_t len) {
#ifdef GZ_AVX512
    __m512i m = _mm512_setzero_si512();
    for (int64_t i = 0; i < len; i += 16) {
        const __m512i u = _mm512_castps_si512(_mm512_maskz_loadu_ps(tail_mask(len - i), x + i));
        m = _mm512_max_epu32(m, _mm512_and_si512(u, SET1(0x7FFFFFFFu)));
    }
    return (uint32_t)_mm512_reduce_max_epu32(m);
#else
    uint32_t m = 0;
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < len; i++) {
        const uint32_t a = f2u(x[i]) & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    return m;
#endif
}

/* codes of clamp_to(x[i] * mult, top) for one block: one per byte (PACK4 0) or two per byte,
 * value i in the low nibble when i is even (PACK4 1; the block starts on a whole byte) */
INLINE void encode_row(const float *x, int64_t len, float mult, uint8_t *out, const int mbits, const int ebias,
                       const int sign_at, const float top, const int pack4) {
#ifdef GZ_AVX512
    const __m512 vm = _mm512_set1_ps(mult), vt = _mm512_set1_ps(top), vnt = _mm512_set1_ps(-top);
    for (int64_t i = 0; i < len; i += 16) {
        const __mmask16 k = tail_mask(len - i);
        const __m512 v = v_clamp(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), vm), vt, vnt);
        const __m512i c = v_to_mini(v, mbits, ebias, sign_at);
        if (pack4) {
            /* lanes 2j and 2j+1 as one 64-bit lane: c[2j] | c[2j+1] << 4 in its low byte */
            const __m512i pair = _mm512_or_si512(c, _mm512_srli_epi64(c, 28));
            const int64_t bytes = len - i >= 16 ? 8 : (len - i + 1) / 2;
            _mm512_mask_cvtepi64_storeu_epi8(out + i / 2, (__mmask8)((1u << bytes) - 1u), pair);
        } else {
            _mm512_mask_cvtepi32_storeu_epi8(out + i, k, c);
        }
    }
#else
    if (!pack4) {
#pragma omp simd
        for (int64_t i = 0; i < len; i++) out[i] = (uint8_t)to_mini(clamp_to(x[i] * mult, top), mbits, ebias, sign_at);
    } else {
        for (int64_t j = 0; j < len / 2; j++) {
            const uint32_t lo = to_mini(clamp_to(x[2 * j] * mult, top), mbits, ebias, sign_at);
            const uint32_t hi = to_mini(clamp_to(x[2 * j + 1] * mult, top), mbits, ebias, sign_at);
            out[j] = (uint8_t)(lo | (hi << 4));
        }
        if (len & 1) out[len / 2] = (uint8_t)to_mini(clamp_to(x[len - 1] * mult, top), mbits, ebias, sign_at);
    }
#endif
}

/* out[i] (= or +=) clamp_to(value(code i) * scale, top) for one block (codes packed as above) */
INLINE void decode_row(const uint8_t *codes, int64_t len, float scale, float top, float *out, int accumulate,
                       const int mbits, const int ebias, const int sign_at, const int special, const int pack4) {
#ifdef GZ_AVX512
    const __m512 vs = _mm512_set1_ps(scale), vt = _mm512_set1_ps(top), vnt = _mm512_set1_ps(-top);
    for (int64_t i = 0; i < len; i += 16) {
        const __mmask16 k = tail_mask(len - i);
        __m512i c;
        if (pack4) {
            const int64_t bytes = len - i >= 16 ? 8 : (len - i + 1) / 2;
            const __m512i b = _mm512_cvtepu8_epi64(_mm_maskz_loadu_epi8((__mmask16)((1u << bytes) - 1u), codes + i / 2));
            c = _mm512_or_si512(_mm512_and_si512(b, _mm512_set1_epi64(15)), _mm512_slli_epi64(_mm512_srli_epi64(b, 4), 32));
        } else {
            c = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, codes + i));
        }
        /* e2m1 has 16 codes: one permute reads them from a register (the values of from_mini) */
        const __m512 e2m1 = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                           -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
        const __m512 value = pack4 ? _mm512_permutexvar_ps(c, e2m1) : v_from_mini(c, mbits, ebias, sign_at, special);
        __m512 v = v_clamp(_mm512_mul_ps(value, vs), vt, vnt);
        if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(k, out + i), v);
        _mm512_mask_storeu_ps(out + i, k, v);
    }
#else
    if (!pack4) {
        if (accumulate) {
#pragma omp simd
            for (int64_t i = 0; i < len; i++) out[i] += clamp_to(from_mini(codes[i], mbits, ebias, sign_at, special) * scale, top);
        } else {
#pragma omp simd
            for (int64_t i = 0; i < len; i++) out[i] = clamp_to(from_mini(codes[i], mbits, ebias, sign_at, special) * scale, top);
        }
    } else {
        for (int64_t i = 0; i < len; i++) {
            const float v = clamp_to(from_mini((codes[i / 2] >> (4 * (i & 1))) & 15u, mbits, ebias, sign_at, special) * scale, top);
            out[i] = accumulate ? out[i] + v : v;
        }
    }
#endif
}

/* fmt 0: e4m3, 1: e5m2. A block's scale is s = max(amax / TOP, 2**-126), its codes those of
 * x * (1 / s) */
INLINE void fp8_encode_fmt(const float *x, int64_t n, int64_t block, uint8_t *codes, float *scales, const int mbits,
                           const int ebias, const float top) {
    const int64_t nb = (n + block - 1) / block;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t start = b * block;
        const int64_t len = n - start < block ? n - start : block;
        float s = u2f(max_magnitude(x + start, len)) / top;
        s = s < FLT_MIN ? FLT_MIN : s; /* keeps 1 / s finite; NaN stays NaN */
        encode_row(x + start, len, 1.0f / s, codes + start, mbits, ebias, 7, top, 0);
        scales[b] = s;
    }
}

void gz_fp8_encode(const float *x, int64_t n, int fmt, int64_t block, uint8_t *codes, float *scales) {
    if (fmt == 0)
        fp8_encode_fmt(x, n, block, codes, scales, 3, 7, 448.0f);
    else
        fp8_encode_fmt(x, n, block, codes, scales, 2, 15, 57344.0f);
}

/* value * s may round above the largest fp32 (a block whose max is near it): clamped where s is finite */
INLINE void fp8_decode_fmt(const uint8_t *codes, const float *scales, int64_t n, int64_t block, float *out,
                           int accumulate, const int mbits, const int ebias, const int special) {
    const int64_t nb = (n + block - 1) / block;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t start = b * block;
        const int64_t len = n - start < block ? n - start : block;
        const float s = scales[b];
        decode_row(codes + start, len, s, isfinite(s) ? FLT_MAX : INFINITY, out + start, accumulate, mbits, ebias, 7,
                   special, 0);
    }
}

void gz_fp8_decode(const uint8_t *codes, const float *scales, int64_t n, int fmt, int64_t block, float *out,
                   int accumulate) {
    if (fmt == 0)
        fp8_decode_fmt(codes, scales, n, block, out, accumulate, 3, 7, 1);
    else
        fp8_decode_fmt(codes, scales, n, block, out, accumulate, 2, 15, 2);
}

/* fp32 2**e for e in -127..127 (2**-127 is subnormal) */
static inline float pow2i(int e) { return e < -126 ? u2f(0x00400000u) : u2f((uint32_t)(e + 127) << 23); }

/* E8M0 code of a block whose largest magnitude has the bits m: floor(log2(amax)) - emax + 127,
 * clamped to 0..254; 255 (NaN) when amax is NaN or inf */
static inline int mx_scale_code(uint32_t m, int emax) {
    const int field = (int)(m >> 23);
    const int code = field - emax < 0 ? 0 : (field - emax > 254 ? 254 : field - emax);
    return field == 255 ? 255 : code;
}

/* elem 0: e4m3 elements, one per byte; 1: e2m1, two per byte. Blocks are multiples of 32 values,
 * so every block starts on a whole byte. */
#ifdef GZ_AVX512
/* Sixteen whole blocks of 32 values (the specification's block) at once: their maxima are
 * reduced into one vector (four rounds of even/odd lane halves), the sixteen scale codes and
 * multipliers computed in its lanes, and each block's multiplier broadcast from there. Same
 * operations as mx_scale_code, pow2i and encode_row, so the same bytes. */
INLINE void mx_encode_16x32(const float *x, uint8_t *codes, uint8_t *scales, const int elem) {
    const int mbits = elem == 0 ? 3 : 1, ebias = elem == 0 ? 7 : 1, emax = elem == 0 ? 8 : 2;
    const int sign_at = elem == 0 ? 7 : 3;
    const float top = elem == 0 ? 448.0f : 6.0f;
    const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odds = _mm512_add_epi32(evens, SET1(1));
    const __m512i magnitude = SET1(0x7FFFFFFFu);
    __m512i m[16];
    for (int b = 0; b < 16; b++)
        m[b] = _mm512_max_epu32(_mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(x + 32 * b)), magnitude),
                                _mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(x + 32 * b + 16)), magnitude));
    for (int width = 16; width > 1; width /= 2) /* lane groups of block b stay in block order */
        for (int k = 0; k < width / 2; k++)
            m[k] = _mm512_max_epu32(_mm512_permutex2var_epi32(m[2 * k], evens, m[2 * k + 1]),
                                    _mm512_permutex2var_epi32(m[2 * k], odds, m[2 * k + 1]));
    const __m512i field = _mm512_srli_epi32(m[0], 23);
    __m512i code = _mm512_min_epi32(_mm512_max_epi32(_mm512_sub_epi32(field, SET1(emax)), SET1(0)), SET1(254));
    code = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(field, SET1(255)), code, SET1(255));
    __m512i mult = _mm512_slli_epi32(_mm512_sub_epi32(SET1(254), code), 23); /* 2**(127 - code) */
    mult = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(code, SET1(254)), mult, SET1(0x00400000u));
    mult = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(code, SET1(255)), mult, SET1(0x3F800000u));
    _mm_storeu_si128((__m128i *)scales, _mm512_cvtepi32_epi8(code));
    const __m512 vt = _mm512_set1_ps(top), vnt = _mm512_set1_ps(-top);
    for (int b = 0; b < 16; b++) {
        const __m512 vm = _mm512_permutexvar_ps(SET1(b), _mm512_castsi512_ps(mult));
        for (int h = 0; h < 2; h++) {
            const __m512 v = v_clamp(_mm512_mul_ps(_mm512_loadu_ps(x + 32 * b + 16 * h), vm), vt, vnt);
            const __m512i c = v_to_mini(v, mbits, ebias, sign_at);
            if (elem == 0)
                _mm_storeu_si128((__m128i *)(codes + 32 * b + 16 * h), _mm512_cvtepi32_epi8(c));
            else
                _mm_storel_epi64((__m128i *)(codes + 16 * b + 8 * h),
                                 _mm512_cvtepi64_epi8(_mm512_or_si512(c, _mm512_srli_epi64(c, 28))));
        }
    }
}
#endif

INLINE void mx_encode_elem(const float *x, int64_t n, int64_t block, uint8_t *codes, uint8_t *scales, const int elem) {
    const int64_t nb = (n + block - 1) / block;
    int64_t b = 0;
#ifdef GZ_AVX512
    if (block == 32)
        for (; b + 16 <= n / 32; b += 16) mx_encode_16x32(x + 32 * b, codes + (elem == 0 ? 32 * b : 16 * b), scales + b, elem);
#endif
    for (; b < nb; b++) {
        const int64_t start = b * block;
        const int64_t len = n - start < block ? n - start : block;
        const int code = mx_scale_code(max_magnitude(x + start, len), elem == 0 ? 8 : 2);
        const float mult = code == 255 ? 1.0f : pow2i(127 - code); /* x / 2**shared, exactly */
        if (elem == 0)
            encode_row(x + start, len, mult, codes + start, 3, 7, 7, 448.0f, 0);
        else
            encode_row(x + start, len, mult, codes + start / 2, 1, 1, 3, 6.0f, 1);
        scales[b] = (uint8_t)code;
    }
}

void gz_mx_encode(const float *x, int64_t n, int elem, int64_t block, uint8_t *codes, uint8_t *scales) {
    if (elem == 0)
        mx_encode_elem(x, n, block, codes, scales, 0);
    else
        mx_encode_elem(x, n, block, codes, scales, 1);
}

/* element * 2**(scale - 127), exact (no clamp needed: |element| * 2**shared stays below FLT_MAX) */
INLINE void mx_decode_elem(const uint8_t *codes, const uint8_t *scales, int64_t n, int64_t block, float *out,
                           int accumulate, const int elem) {
    const int64_t nb = (n + block - 1) / block;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t start = b * block;
        const int64_t len = n - start < block ? n - start : block;
        const float sc = scales[b] == 255 ? u2f(0x7FC00000u) : pow2i((int)scales[b] - 127);
        if (elem == 0)
            decode_row(codes + start, len, sc, INFINITY, out + start, accumulate, 3, 7, 7, 1, 0);
        else
            decode_row(codes + start / 2, len, sc, INFINITY, out + start, accumulate, 1, 1, 3, 0, 1);
    }
}

void gz_mx_decode(const uint8_t *codes, const uint8_t *scales, int64_t n, int elem, int64_t block, float *out,
                  int accumulate) {
    if (elem == 0)
        mx_decode_elem(codes, scales, n, block, out, accumulate, 0);
    else
        mx_decode_elem(codes, scales, n, block, out, accumulate, 1);
}

/* ---------------------------------------------------------------- saturating cast (fp16, bf16)
 * fp32 to the bits of fp16 (bf16 = 0) or bf16 (bf16 = 1), as reference.saturate: finite values
 * beyond the type's largest value become it, the rest round to nearest even (subnormals too);
 * ±inf stay ±inf and NaN becomes the quiet NaN of its sign. One pass: the fp16 and bf16 codecs'
 * encode at the speed of a copy, where torch's version makes four. */
INLINE uint16_t saturated16(float v, const int mbits, const int ebias, const float top, const uint32_t inf) {
    const uint32_t u = f2u(v), a = u & 0x7FFFFFFFu, sign = (u >> 16) & 0x8000u;
    if (a >= 0x7F800000u) return (uint16_t)(sign | inf | (a == 0x7F800000u ? 0u : 1u << (mbits - 1)));
    return (uint16_t)to_mini(clamp_to(v, top), mbits, ebias, 15);
}

void gz_saturate(const float *x, int64_t n, int bf16, uint16_t *out) {
    if (bf16) {
        const float top = u2f(0x7F7F0000u);
        for (int64_t i = 0; i < n; i++) out[i] = saturated16(x[i], 7, 127, top, 0x7F80u);
    } else {
        for (int64_t i = 0; i < n; i++) out[i] = saturated16(x[i], 10, 15, 65504.0f, 0x7C00u);
    }
}

/* ------------------------------------------------------------ element-wise codecs of GRACE
 * TernGrad, TBQ, natural compression, the 8-bit table and 1-bit SGD's decode: each value's code
 * depends on the value, a counter draw and its bucket's statistic alone, so one pass writes what
 * the torch versions make in six to ten (reference.py: terngrad_encode, tbq_encode,
 * ternary_decode, natural_codes, natural_decode, u8bit_codes, table_decode, onebit_decode).
 * `bucket` values share a statistic; the loops walk a bucket at a time, so no value divides its
 * index. */
#define SPAN 4096 /* values of 2-bit codes made before they are packed (a multiple of 8) */

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Each of the `rows` rows' max |x| (NaN where the row holds one, as torch.amax). */
static void row_absmax(const float *x, int64_t rows, int64_t bucket, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * bucket;
        float m = 0.0f;
        int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t i = 0; i < bucket; i++) {
            const float a = fabsf(v[i]);
            m = a > m ? a : m;
            nan |= a != a;
        }
        out[r] = nan ? NAN : m;
    }
}

/* Each row's max |x| (NaN where it holds one): TernGrad's and the 8-bit format's scales, the
 * blocks' maxima of a fused group. */
void gz_row_absmax(const float *x, int64_t rows, int64_t bucket, float *out) { row_absmax(x, rows, bucket, out); }

/* 1-bit SGD's statistics of each row, three doubles a row: the sum of its negative values,
 * the sum of its non-negative ones (each side clamped at 0 in fp32, as torch's clamp, then
 * summed in fp64: no overflow; a NaN stays), and how many are >= 0. The sums' order is not
 * torch's: their last fp64 bits may differ, which no replica sees (a rank's means are its own,
 * sent in its payload). */
void gz_side_sums(const float *x, int64_t rows, int64_t bucket, double *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * bucket;
        double neg = 0.0, pos = 0.0, count = 0.0;
#pragma omp simd reduction(+ : neg, pos, count)
        for (int64_t i = 0; i < bucket; i++) {
            neg += (double)(v[i] > 0.0f ? 0.0f : v[i]);
            pos += (double)(v[i] < 0.0f ? 0.0f : v[i]);
            count += v[i] >= 0.0f ? 1.0 : 0.0;
        }
        out[3 * r] = neg;
        out[3 * r + 1] = pos;
        out[3 * r + 2] = count;
    }
}

/* TernGrad: x holds rows of `bucket` values (the last one padded); scale is given (given != 0,
 * one a row) or each row's max |x| is written there. Value i is kept with probability
 * |x| / scale (draw uniform(i, key)): code 1 for +1, 2 for -1, else 0; 0/0 keeps nothing. */
void gz_terngrad_encode(const float *x, int64_t n, int64_t rows, int64_t bucket, uint32_t key, int given,
                        float *scale, uint8_t *packed) {
    if (!given) row_absmax(x, rows, bucket, scale);
    uint8_t lv[SPAN];
    const int64_t total = round_up8(n);
    for (int64_t a = 0; a < total; a += SPAN) {
        const int64_t len = min64(SPAN, total - a), stop = min64(a + len, n);
        int64_t i = a;
        while (i < stop) {
            const int64_t r = i / bucket, end = min64((r + 1) * bucket, stop);
            const float s = scale[r];
#pragma omp simd
            for (int64_t j = i; j < end; j++) {
                const float v = x[j];
                const int keep = uniform(j, key) < fabsf(v) / s;
                lv[j - a] = (uint8_t)(keep ? (v < 0.0f ? 2 : 1) : 0);
            }
            i = end;
        }
        for (; i < a + len; i++) lv[i - a] = 0;
        pack(lv, len, 2, packed + a / 4);
    }
}

/* TBQ: code 1 where x > tau, 2 where x < -tau (compared in fp32), else 0. */
void gz_tbq_encode(const float *x, int64_t n, float tau, uint8_t *packed) {
    uint8_t lv[SPAN];
    const int64_t total = round_up8(n);
    for (int64_t a = 0; a < total; a += SPAN) {
        const int64_t len = min64(SPAN, total - a), stop = min64(a + len, n);
#pragma omp simd
        for (int64_t j = a; j < stop; j++) lv[j - a] = (uint8_t)((x[j] > tau) | ((x[j] < -tau) << 1));
        for (int64_t j = stop; j < a + len; j++) lv[j - a] = 0;
        pack(lv, len, 2, packed + a / 4);
    }
}

/* Codes of `bits` bits (1 or 2: a compile-time constant in each caller) decoded through their
 * bucket's statistics, `per` floats a bucket, a span at a time: the codes unpacked, then each
 * bucket's run with its statistics loaded once. */
INLINE void decode_by_buckets(const uint8_t *packed, const float *side, int64_t n, int64_t bucket, float *out,
                              int accumulate, const int bits) {
    uint8_t lv[SPAN];
    for (int64_t a = 0; a < n; a += SPAN) {
        const int64_t stop = min64(a + SPAN, n);
        unpack(packed + a * bits / 8, round_up8(stop - a), bits, lv);
        for (int64_t i = a; i < stop;) {
            const int64_t r = i / bucket, end = min64((r + 1) * bucket, stop);
            const float s0 = side[bits == 1 ? 2 * r : r], s1 = bits == 1 ? side[2 * r + 1] : 0.0f;
#pragma omp simd
            for (int64_t j = i; j < end; j++) {
                const int c = lv[j - a];
                /* 1 bit: c * mean_pos + (1 - c) * mean_neg, both products made, as in torch (NaN
                   where the other mean is not finite); 2 bits: 0, +1, -1, 0 times the scale (made
                   for every code, so 0 times a non-finite scale is NaN, as in torch) */
                const float v = bits == 1 ? (float)c * s1 + (1.0f - (float)c) * s0 : (float)((c & 1) - (c >> 1)) * s0;
                out[j] = accumulate ? out[j] + v : v;
            }
            i = end;
        }
    }
}

/* TernGrad's and TBQ's 2-bit codes times their bucket's scale. */
void gz_ternary_decode(const uint8_t *packed, const float *scale, int64_t n, int64_t bucket, float *out,
                       int accumulate) {
    decode_by_buckets(packed, scale, n, bucket, out, accumulate, 2);
}

/* The values [i, end) that share value i's header: all of them (shift < 0: one header) or the
 * rest of its bucket of 2**shift values. */
static inline int64_t header_end(int64_t i, int shift, int64_t n) {
    return shift < 0 ? n : min64(((i >> shift) + 1) << shift, n);
}

/* Natural compression: bits are the fp32 values' bits; the draw is the top 23 bits of
 * uniform(i, key). Code c in 1..127 is the exponent field top - 127 + c, the sign in bit 7; a
 * magnitude below code 1's power of two becomes that power with probability |x| over it, else 0.
 * The integer steps and the two fp32 products of reference.natural_codes. */
void gz_natural_codes(const int32_t *bits, int64_t n, uint32_t key, const int32_t *top, int shift, uint8_t *out) {
    for (int64_t i = 0; i < n;) {
        const int64_t end = header_end(i, shift, n);
        const int32_t first = top[shift < 0 ? 0 : i >> shift] - 126;
        int32_t e = 254 - first;
        e = e < 1 ? 1 : (e > 254 ? 254 : e);
        const float scale = u2f((uint32_t)e << 23);
#pragma omp simd
        for (int64_t j = i; j < end; j++) {
            const int32_t b = bits[j];
            int32_t mag = b & 0x7FFFFFFF;
            mag = mag < 0x7F800000 ? mag : 0x7F800000;
            /* uniform(j, key) * 2**23, truncated: the hash's top 23 bits (an integer form the
               compiler vectorises, where the float conversion kept it scalar) */
            const int32_t rand = (int32_t)(mix((uint32_t)j, key) >> 9);
            const int32_t rounded = (mag + rand) >> 23;
            const int32_t code_in = rounded > 0 ? rounded - (first - 1) : 0;
            float m;
            memcpy(&m, &mag, sizeof m);
            const int32_t code_under = (float)rand * (1.0f / 8388608.0f) < m * scale;
            const int32_t code = (mag >> 23) >= first ? code_in : code_under;
            const int32_t sign = (int32_t)((uint32_t)b >> 31) & (code > 0);
            out[j] = (uint8_t)(code | (sign << 7));
        }
        i = end;
    }
}

/* fp32 +-2**(top - 254 + c) for code c in 1..127 (the field clamped to 0..255, and to the largest
 * fp32 under a finite header), 0 for code 0. */
void gz_natural_decode(const uint8_t *codes, const int32_t *top, int shift, int64_t n, float *out, int accumulate) {
    for (int64_t i = 0; i < n;) {
        const int64_t end = header_end(i, shift, n);
        const int32_t t = top[shift < 0 ? 0 : i >> shift], cap = t <= 255 ? 0x7F7FFFFF : 0x7F800000;
#pragma omp simd
        for (int64_t j = i; j < end; j++) {
            const int32_t c = codes[j], code = c & 127;
            int32_t field = code + (t - 127);
            field = (field < 0 ? 0 : (field > 255 ? 255 : field)) << 23;
            field = field < cap ? field : cap;
            const float v = u2f((uint32_t)(code > 0 ? field : 0) | ((uint32_t)(c >> 7) << 31));
            out[j] = accumulate ? out[j] + v : v;
        }
        i = end;
    }
}

/* 8-bit codes: v = x * inv of the value's bucket, then lut[key] + (mids[lut[key]] < v), key the
 * top 16 bits of v's fp32 (the nearest of the table's values, as reference.u8bit_codes). */
void gz_u8bit_codes(const float *x, int64_t n, int64_t bucket, const float *inv, const float *mids,
                    const int32_t *lut, uint8_t *out) {
    for (int64_t i = 0; i < n;) {
        const int64_t r = i / bucket, end = min64((r + 1) * bucket, n);
        const float s = inv[r];
#pragma omp simd
        for (int64_t j = i; j < end; j++) {
            const float v = x[j] * s;
            const int32_t first = lut[f2u(v) >> 16];
            out[j] = (uint8_t)(first + (mids[first] < v));
        }
        i = end;
    }
}

/* table[code] times its bucket's scale (scale NULL: table[code] alone). */
void gz_table_decode(const uint8_t *codes, const float *table, const float *scale, int64_t n, int64_t bucket,
                     float *out, int accumulate) {
    for (int64_t i = 0; i < n;) {
        const int64_t r = i / bucket, end = min64((r + 1) * bucket, n);
        const float s = scale ? scale[r] : 1.0f;
        const int scaled = scale != NULL;
#pragma omp simd
        for (int64_t j = i; j < end; j++) {
            const float t = table[codes[j]], v = scaled ? t * s : t;
            out[j] = accumulate ? out[j] + v : v;
        }
        i = end;
    }
}

/* 1-bit SGD's bits through their bucket's means ([neg, pos] a bucket). */
void gz_onebit_decode(const uint8_t *packed, const float *means, int64_t n, int64_t bucket, float *out,
                      int accumulate) {
    decode_by_buckets(packed, means, n, bucket, out, accumulate, 1);
}

/* ------------------------------------------------------------------ the sparsifiers' selection
 * The ascending indices of the values whose |x| reaches `threshold` or, with `thresholds` (one
 * a block of `span` values), their block's, among each block's first valid[b] values (NaN
 * reaches none): reference.select_magnitudes. Two passes over x: the count, stopping once it
 * passes `most` (-1 then: the caller sends the values densely), then the indices into `idx`
 * (NULL: count only). */
static inline int picked(const float *x, int64_t i, float threshold, const float *thresholds,
                         const int32_t *valid, int64_t span) {
    if (thresholds == NULL) return fabsf(x[i]) >= threshold;
    const int64_t b = i / span;
    return fabsf(x[i]) >= thresholds[b] && i - b * span < valid[b];
}

int64_t gz_select(const float *x, int64_t n, float threshold, const float *thresholds, const int32_t *valid,
                  int64_t span, int64_t most, int64_t *idx) {
    int64_t count = 0;
    if (idx == NULL) {
        for (int64_t a = 0; a < n; a += SPAN) {
            const int64_t stop = min64(a + SPAN, n);
            int64_t c = 0;
            if (thresholds == NULL) {
#pragma omp simd reduction(+ : c)
                for (int64_t i = a; i < stop; i++) c += fabsf(x[i]) >= threshold;
            } else {
                for (int64_t i = a; i < stop; i++) c += picked(x, i, threshold, thresholds, valid, span);
            }
            count += c;
            if (most >= 0 && count > most) return -1;
        }
        return count;
    }
    for (int64_t i = 0; i < n; i++)
        if (picked(x, i, threshold, thresholds, valid, span)) idx[count++] = i;
    return count;
}

/* ------------------------------------------------------------------------------- INCEPTIONN
 * reference.inceptionn_encode / _decode: each value's 2-bit tag (0: under the bound, nothing
 * sent; 1 and 2: sign and 7 or 15 bits of m = floor(|x| / step + 0.5); 3: the raw value) and
 * its 0/1/2/raw-width bytes in value order. `fmt` is the input's format: 0 fp32 (fp64 comes
 * converted), 1 fp16, 2 bf16 (16-bit inputs come as their bits; their decode is checked after
 * the cast back to that format, and their raw values take 2 bytes). */
#define INC_FP16 1
#define INC_BF16 2

/* The 16-bit format's value nearest v >= 0 (ties to even; beyond its range inf), as a float:
 * torch's cast and back. */
static inline float inc_cast_back(float v, int fmt) {
    if (v != v) return v;
    uint32_t u = f2u(v);
    if (fmt == INC_BF16) {
        u += 0x7FFFu + ((u >> 16) & 1u);
        return u2f(u & 0xFFFF0000u);
    }
    if (v >= 65520.0f) return INFINITY;
    if (v < 6.103515625e-05f) {  /* fp16 subnormals: multiples of 2**-24, to nearest even in the FPU */
        const float r = v * 16777216.0f;
        return ((r + 8388608.0f) - 8388608.0f) * (1.0f / 16777216.0f);
    }
    u += 0x0FFFu + ((u >> 13) & 1u);
    return u2f(u & ~0x1FFFu);
}

/* A 16-bit value's float (exact). */
static inline float inc_widen(uint16_t h, int fmt) {
    if (fmt == INC_BF16) return u2f((uint32_t)h << 16);
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, mant = h & 1023u;
    if (e == 0) {
        const float v = (float)mant * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    if (e == 31) return u2f(sign | 0x7F800000u | (mant << 13));
    return u2f(sign | ((e + 112u) << 23) | (mant << 13));
}

/* Value i's tag and the word whose first bytes are sent (branch-free: tags follow the data). */
static inline int inc_tag(const void *x, int64_t i, int fmt, float bound, float step, uint32_t *word) {
    float xf;
    uint32_t raw;
    if (fmt == 0) {
        xf = ((const float *)x)[i];
        raw = f2u(xf);
    } else {
        const uint16_t h = ((const uint16_t *)x)[i];
        xf = inc_widen(h, fmt);
        raw = h;
    }
    const float mag = fabsf(xf), m = floorf(mag / step + 0.5f);
    float approx = m * step;
    if (fmt != 0) approx = inc_cast_back(approx, fmt);
    const int ok = fabsf(approx - mag) <= bound;
    const int tag = (3 - (ok & (m <= 32767.0f)) - (ok & (m <= 127.0f))) * !(mag < bound);
    const uint32_t fixed = (tag == 1 || tag == 2) ? (uint32_t)m | ((uint32_t)(xf < 0.0f) << (8 * tag - 1)) : 0u;
    *word = tag == 3 ? raw : fixed;
    return tag;
}

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define INC_WORDS 1 /* a word's first bytes are its low ones: whole words are written and read */
#endif

/* The tags into `packed` (round_up8(n) / 4 bytes) and the stream's length; with `stream` (of
 * `size` bytes, the length a first call returned), the bytes too. A span's tags and words are
 * made first (vectorised), then its bytes placed in order (the one serial step). */
int64_t gz_inceptionn_encode(const void *x, int64_t n, int fmt, float bound, float step, uint8_t *packed,
                             uint8_t *stream, int64_t size) {
    const int64_t width = fmt == 0 ? 4 : 2;
    int64_t at = 0;
    uint8_t lv[SPAN];
    uint32_t words[SPAN];
    const int64_t total = round_up8(n);
    for (int64_t a = 0; a < total; a += SPAN) {
        const int64_t len = min64(SPAN, total - a), stop = min64(a + len, n);
#pragma omp simd
        for (int64_t i = a; i < stop; i++) lv[i - a] = (uint8_t)inc_tag(x, i, fmt, bound, step, &words[i - a]);
        for (int64_t i = stop; i < a + len; i++) lv[i - a] = 0;
        if (stream == NULL) {
            for (int64_t i = 0; i < stop - a; i++) at += lv[i] == 3 ? width : lv[i];
            pack(lv, len, 2, packed + a / 4);
            continue;
        }
        for (int64_t i = 0; i < stop - a; i++) {
            const int64_t bytes = lv[i] == 3 ? width : lv[i];
#ifdef INC_WORDS
            if (at + 4 <= size) {  /* the whole word: the next value's bytes overwrite what is not this one's */
                memcpy(stream + at, &words[i], 4);
                at += bytes;
                continue;
            }
#endif
            for (int64_t b = 0; b < bytes; b++) stream[at + b] = (uint8_t)(words[i] >> (8 * b));
            at += bytes;
        }
    }
    return at;
}

/* The stream's length the n tags in `packed` say (the decode's check: a stream shorter than
 * that is no payload the encoder made). */
int64_t gz_inceptionn_size(const uint8_t *packed, int64_t n, int fmt) {
    const int64_t width = fmt == 0 ? 4 : 2;
    int64_t total = 0;
    uint8_t lv[SPAN];
    for (int64_t a = 0; a < n; a += SPAN) {
        const int64_t stop = min64(a + SPAN, n);
        unpack(packed + a / 4, round_up8(stop - a), 2, lv);
        for (int64_t i = 0; i < stop - a; i++) total += lv[i] == 3 ? width : lv[i];
    }
    return total;
}

/* The values of the tags and the stream (`size` bytes; a byte past its end, which no stream
 * the encoder made holds, reads as zero: never out of bounds), stored or added into `out`: a
 * span's words gathered in order (the serial step), then their values (vectorised). */
void gz_inceptionn_decode(const uint8_t *packed, const uint8_t *stream, int64_t size, int64_t n, int fmt, float step,
                          float *out, int accumulate) {
    static const uint32_t keep[5] = {0u, 0xFFu, 0xFFFFu, 0xFFFFFFu, 0xFFFFFFFFu};
    const int64_t width = fmt == 0 ? 4 : 2;
    int64_t at = 0;
    uint8_t lv[SPAN];
    uint32_t words[SPAN];
    for (int64_t a = 0; a < n; a += SPAN) {
        const int64_t stop = min64(a + SPAN, n);
        unpack(packed + a / 4, round_up8(stop - a), 2, lv);
        for (int64_t i = 0; i < stop - a; i++) {
            const int64_t bytes = lv[i] == 3 ? width : lv[i];
            uint32_t word = 0;
#ifdef INC_WORDS
            if (at + 4 <= size) {
                memcpy(&word, stream + at, 4);
                word &= keep[bytes];
            } else
#endif
                for (int64_t b = 0; b < bytes; b++) word |= (uint32_t)(at + b < size ? stream[at + b] : 0) << (8 * b);
            words[i] = word;
            at += bytes;
        }
#pragma omp simd
        for (int64_t i = a; i < stop; i++) {
            const int tag = lv[i - a];
            const uint32_t word = words[i - a];
            const int sign_at = tag == 0 ? 0 : 8 * tag - 1;
            float v = (float)(word & ((1u << sign_at) - 1u)) * step;
            v = ((word >> sign_at) & 1u) ? -v : v;
            v = tag == 3 ? (fmt == 0 ? u2f(word) : inc_widen((uint16_t)word, fmt)) : v;
            out[i] = accumulate ? out[i] + v : v;
        }
    }
}

/* --------------------------------------------------------------------------------- SketchML
 * codecs/sketch.py's quantile sketch: each value's key is the top bits of its fp32 pattern made
 * order-preserving (negative values' magnitude bits flipped, an arithmetic shift by `shift`,
 * plus the key of +0.0), every NaN the last cell's. */
static inline int32_t sketch_key(float v, int shift, int32_t zero_key, int32_t cells) {
    const int32_t b = (int32_t)f2u(v);
    const int32_t s = (((b >> 31) & 0x7FFFFFFF) ^ b) >> shift;
    return v != v ? cells - 1 : s + zero_key;
}

/* Each cell's count and fp64 sum of its values, added in index order (torch's index_add_ on
 * the CPU: the same sums). */
void gz_sketch_cells(const float *x, int64_t n, int shift, int32_t zero_key, int32_t cells, double *hist,
                     double *sums) {
    for (int64_t i = 0; i < n; i++) {
        const int32_t k = sketch_key(x[i], shift, zero_key, cells);
        hist[k] += 1.0;
        sums[k] += (double)x[i];
    }
}

/* Each value's bucket, lut[key], packed in `bits` bits. */
void gz_sketch_codes(const float *x, int64_t n, int shift, int32_t zero_key, int32_t cells, const uint8_t *lut,
                     int bits, uint8_t *packed) {
    uint8_t lv[SPAN];
    for (int64_t a = 0; a < n; a += SPAN) {
        const int64_t stop = min64(a + SPAN, n), len = bits == 8 ? stop - a : round_up8(stop - a);
        for (int64_t i = a; i < stop; i++) lv[i - a] = lut[sketch_key(x[i], shift, zero_key, cells)];
        for (int64_t i = stop - a; i < len; i++) lv[i] = 0;
        pack(lv, len, bits, packed + packed_offset(a, bits));
    }
}

/* Codes of `bits` bits through a table of 256 floats (SketchML's bucket means, padded): each
 * value table[code], stored or added into `out`. */
void gz_codes_decode(const uint8_t *packed, int bits, const float *table, int64_t n, float *out, int accumulate) {
    uint8_t lv[SPAN];
    for (int64_t a = 0; a < n; a += SPAN) {
        const int64_t stop = min64(a + SPAN, n), len = bits == 8 ? stop - a : round_up8(stop - a);
        unpack(packed + packed_offset(a, bits), len, bits, lv);
#pragma omp simd
        for (int64_t i = a; i < stop; i++) out[i] = accumulate ? out[i] + table[lv[i - a]] : table[lv[i - a]];
    }
}

/* ---------------------------------------------------------------------------------- AdaComp
 * codecs/sparse.py's AdaQ selection: in each bin of `size` values, those whose h reaches the
 * bin's max |g| (none where the bin holds a NaN), never a zero; h = |2g - prev| with a previous
 * residual, else 2|g| (`doubled`) or |g|. Each bin's count into `counts`; the ascending indices
 * into `idx` (NULL: the counts alone; else `room` of them, one more than a first call returned:
 * no write goes past it, even if the values changed between the calls). Returns how many. */
int64_t gz_adacomp_select(const float *g, const float *prev, int64_t n, int64_t size, int doubled, int64_t *counts,
                          int64_t *idx, int64_t room) {
    int64_t total = 0;
    for (int64_t a = 0, bin = 0; a < n; a += size, bin++) {
        const int64_t e = min64(a + size, n);
        float top = 0.0f;
        int nan = 0;
#pragma omp simd reduction(max : top) reduction(| : nan)
        for (int64_t i = a; i < e; i++) {
            const float m = fabsf(g[i]);
            top = m > top ? m : top;
            nan |= m != m;
        }
        int64_t c = 0;
        if (!nan && idx == NULL) {
#pragma omp simd reduction(+ : c)
            for (int64_t i = a; i < e; i++) {
                const float m = fabsf(g[i]);
                const float h = prev != NULL ? fabsf(2.0f * g[i] - prev[i]) : (doubled ? 2.0f * m : m);
                c += (h >= top) & (m > 0.0f);
            }
        } else if (!nan) {  /* branch-free: every index written, the next one over it unless kept (idx: total + 1) */
            for (int64_t i = a; i < e; i++) {
                const float m = fabsf(g[i]);
                const float h = prev != NULL ? fabsf(2.0f * g[i] - prev[i]) : (doubled ? 2.0f * m : m);
                idx[min64(total + c, room - 1)] = i;
                c += (h >= top) & (m > 0.0f);
            }
        }
        counts[bin] = c;
        total += c;
    }
    return total;
}
