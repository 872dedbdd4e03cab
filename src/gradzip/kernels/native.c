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

static void min_max(const float *x, int64_t len, float *lo_out, float *hi_out) {
    float lo = x[0], hi = x[0];
#pragma omp simd reduction(min : lo) reduction(max : hi)
    for (int64_t i = 0; i < len; i++) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
    }
    *lo_out = lo;
    *hi_out = hi;
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
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return u & 0x7FFFFFFFu;
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
