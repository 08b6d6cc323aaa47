/* The per-channel arithmetic of syncbn.py's SyncBatchNorm on the CPU, one C call where PyTorch would dispatch
 * several operations on (C) vectors: each dispatch costs as much as a pass over x at the homework's sizes.
 * The first functions touch C values each, beside BatchNorm's kernels for the passes over x; the second half of
 * the file (the whole layer) makes those passes too, on a contiguous (N, C) x.
 *
 * The formulas, and their order of rounding, are those of syncbn.py's pure-PyTorch path (its fallback where no C
 * compiler is found), line for line: see the function of syncbn.py named in each comment. T is float or double,
 * the dtype the statistics are computed in; the sums across ranks are float64 (the forward's) or T (backward's).
 * Built by dpkit/native/__init__.py with -ffp-contract=off, so that no a * b + c becomes one rounding.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHANNEL_FUNCTIONS(T, NAME, SQRT)                                                                          \
                                                                                                                  \
/* _global_moments, before the sum: this rank's mean m and biased variance v (C each) of n values per channel   \
 * -> packed (2C + 1 doubles) = [n m, n v + (n m)^2 / n, n]; an empty rank (n = 0) sends zeros. */              \
void syncbn_pack_##NAME(const T *mean, const T *var, int64_t channels, int64_t count, double *packed) {           \
    if (!count) {                                                                                                 \
        memset(packed, 0, (2 * channels + 1) * sizeof(double));                                                   \
        return;                                                                                                   \
    }                                                                                                             \
    const double n = (double)count, inverse = 1.0 / n;                                                            \
    for (int64_t c = 0; c < channels; ++c) {                                                                      \
        const double sum = (double)mean[c] * n;                                                                   \
        packed[c] = sum;                                                                                          \
        packed[channels + c] = (double)var[c] * n + inverse * sum * sum;                                          \
    }                                                                                                             \
    packed[2 * channels] = n;                                                                                     \
}                                                                                                                 \
                                                                                                                  \
/* _global_moments after the sum, and _update_running_stats: packed holds the global [S, Q, N]; writes the       \
 * global mean S / N and biased variance max(Q - S^2 / N, 0) / N into mean and var, and when running_mean is not \
 * NULL updates the running statistics with factor momentum (the variance unbiased: times N / (N - 1)). Returns N; \
 * N < 2 writes nothing. packed is only read. */                                                                 \
int64_t syncbn_combine_##NAME(const double *packed, int64_t channels, T *mean, T *var, T *running_mean,          \
                              T *running_var, double momentum) {                                                  \
    const double total = packed[2 * channels];                                                                    \
    if (total < 2) return (int64_t)total;                                                                         \
    const double minus_inverse = -1.0 / total;                                                                    \
    const T weight = (T)momentum, keep = (T)(1 - momentum), unbiased = (T)(momentum * total / (total - 1));       \
    for (int64_t c = 0; c < channels; ++c) {                                                                      \
        const double sum = packed[c];                                                                             \
        double m2 = packed[channels + c] + minus_inverse * sum * sum;                                             \
        m2 = m2 < 0 ? 0 : m2;                                                                                     \
        const T m = (T)(sum / total), v = (T)(m2 / total);                                                        \
        mean[c] = m;                                                                                              \
        var[c] = v;                                                                                               \
        if (running_mean) {  /* torch.lerp's formula: from the nearer end */                                     \
            const T old = running_mean[c];                                                                        \
            running_mean[c] = weight < (T)0.5 ? old + weight * (m - old) : m - (m - old) * ((T)1 - weight);       \
            running_var[c] = running_var[c] * keep + unbiased * v;                                                \
        }                                                                                                         \
    }                                                                                                             \
    return (int64_t)total;                                                                                        \
}                                                                                                                 \
                                                                                                                  \
/* _minus_means: this rank's sum(dy) and sum(dy * x_hat) (C each) -> rows[0:2C] = -[sum(dy), sum(dy x_hat)] / N. */\
void syncbn_stage_##NAME(const T *sum_dy, const T *sum_dy_xhat, int64_t channels, int64_t total, T *rows) {      \
    const T scale = (T)(-1.0 / (double)total);                                                                    \
    for (int64_t c = 0; c < channels; ++c) {                                                                      \
        rows[c] = sum_dy[c] * scale;                                                                              \
        rows[channels + c] = sum_dy_xhat[c] * scale;                                                              \
    }                                                                                                             \
}                                                                                                                 \
                                                                                                                  \
/* _input_grad's coefficients: rows (2C) holds the global [-a, -b]; s = weight / sqrt(var + eps) (weight NULL: 1); \
 * coefficients (3C) = [gamma, alpha', s] = [-s a, -s b, s]. */                                                  \
void syncbn_coefficients_##NAME(const T *rows, const T *weight, const T *var, double eps, int64_t channels,      \
                                T *coefficients) {                                                                \
    for (int64_t c = 0; c < channels; ++c) {                                                                      \
        const T invstd = (T)1 / SQRT(var[c] + (T)eps);                                                            \
        const T s = weight ? invstd * weight[c] : invstd;                                                         \
        coefficients[c] = rows[c] * s;                                                                            \
        coefficients[channels + c] = rows[channels + c] * s;                                                      \
        coefficients[2 * channels + c] = s;                                                                       \
    }                                                                                                             \
}

CHANNEL_FUNCTIONS(float, float32, sqrtf)
CHANNEL_FUNCTIONS(double, float64, sqrt)

/* ---------------------------------------------------------------------------------------------------------------
 * The whole layer on a contiguous x of shape (N, C), for where a C loop beats a PyTorch dispatch (syncbn.py
 * decides): the same formulas, with the passes over x here, so that a forward and a backward are two calls each
 * around their sums. x, y, dy and dx are of the input's dtype S (float, double, or bfloat16 as its 16 bits), the
 * per-channel values of the statistics' dtype T (float for bfloat16, as BatchNorm). Sums over x are float64, four
 * rows per update of a channel's sum, so that the loops over c vectorize; an output element is computed in T and
 * rounded once to S. Scratch of C values comes from malloc; a failed malloc returns -1 and writes nothing.
 */

static inline float load_float32(float v) { return v; }
static inline float store_float32(float v) { return v; }
static inline double load_float64(double v) { return v; }
static inline double store_float64(double v) { return v; }
/* bfloat16 is float's upper 16 bits; rounding to it is to nearest, ties to even, NaN kept NaN (as c10::BFloat16). */
static inline float load_bfloat16(uint16_t v) {
    const uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
static inline uint16_t store_bfloat16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* For each channel c: ACC[c] += TERM over the elements k = i C + c of every row i (TERM reads k and c), in float64,
 * the terms of four rows added before they meet the sum. */
#define SUM_ROWS(ACC, TERM)                                                                                       \
    {                                                                                                             \
        int64_t i = 0;                                                                                            \
        for (; i + 4 <= batch; i += 4)                                                                            \
            for (int64_t c = 0; c < channels; ++c) {                                                              \
                double rows = 0;                                                                                  \
                for (int64_t r = 0; r < 4; ++r) { const int64_t k = (i + r) * channels + c; rows += TERM; }       \
                ACC[c] += rows;                                                                                   \
            }                                                                                                     \
        for (; i < batch; ++i)                                                                                    \
            for (int64_t c = 0; c < channels; ++c) { const int64_t k = i * channels + c; ACC[c] += TERM; }        \
    }

#define WHOLE_FUNCTIONS(S, T, NAME, COMPUTE, SQRT)                                                                \
                                                                                                                  \
/* Forward before the sum: x's per-channel sum S_r and squares about its mean M2_r (two passes) -> packed =       \
 * [S_r, M2_r + S_r^2 / n, n], n = N (syncbn_pack's, without rounding the mean to T). */                         \
int64_t syncbn_local_sums_##NAME(const S *x, int64_t batch, int64_t channels, double *packed) {                   \
    double *sum = packed, *square = packed + channels, *mean = malloc(channels * sizeof(double));                  \
    if (!mean) return -1;                                                                                         \
    const double n = (double)batch;                                                                               \
    for (int64_t c = 0; c < channels; ++c) sum[c] = square[c] = 0;                                                \
    SUM_ROWS(sum, (double)load_##NAME(x[k]))                                                                      \
    for (int64_t c = 0; c < channels; ++c) mean[c] = batch ? sum[c] / n : 0;                                      \
    SUM_ROWS(square, ((double)load_##NAME(x[k]) - mean[c]) * ((double)load_##NAME(x[k]) - mean[c]))             \
    for (int64_t c = 0; c < channels; ++c) square[c] += batch ? sum[c] * sum[c] / n : 0;                          \
    packed[2 * channels] = n;                                                                                     \
    free(mean);                                                                                                   \
    return 0;                                                                                                     \
}                                                                                                                 \
                                                                                                                  \
/* Forward after the sum: syncbn_combine_, then y = x alpha + beta with alpha = weight invstd, beta = bias -      \
 * mean alpha (BatchNorm's inference kernel; weight, bias NULL: 1, 0). Returns N; N < 2 writes nothing. */       \
int64_t syncbn_normalize_##NAME(const double *packed, int64_t channels, T *mean, T *var, T *running_mean,        \
                                T *running_var, double momentum, const T *weight, const T *bias, double eps,      \
                                const S *x, int64_t batch, S *y) {                                                \
    const int64_t total = syncbn_combine_##COMPUTE(packed, channels, mean, var, running_mean, running_var,        \
                                                   momentum);                                                     \
    if (total < 2) return total;                                                                                  \
    T *alpha = malloc(2 * channels * sizeof(T)), *beta = alpha + channels;                                        \
    if (!alpha) return -1;                                                                                        \
    for (int64_t c = 0; c < channels; ++c) {                                                                      \
        const T invstd = (T)1 / SQRT(var[c] + (T)eps);                                                            \
        alpha[c] = weight ? invstd * weight[c] : invstd;                                                          \
        beta[c] = (bias ? bias[c] : (T)0) - mean[c] * alpha[c];                                                   \
    }                                                                                                             \
    for (int64_t i = 0; i < batch; ++i)                                                                           \
        for (int64_t c = 0, k = i * channels; c < channels; ++c, ++k)                                             \
            y[k] = store_##NAME(load_##NAME(x[k]) * alpha[c] + beta[c]);                                          \
    free(alpha);                                                                                                  \
    return total;                                                                                                 \
}                                                                                                                 \
                                                                                                                  \
/* Backward before the sum: this rank's sum(dy) and sum(dy x_hat) = invstd sum(dy (x - mean)) into sum_dy and     \
 * sum_dy_xhat (C each: the local gradients of bias and weight), and syncbn_stage_'s rows. */                    \
int64_t syncbn_backward_sums_##NAME(const S *dy, const S *x, const T *mean, const T *var, double eps,            \
                                    int64_t batch, int64_t channels, int64_t total, T *sum_dy, T *sum_dy_xhat,    \
                                    T *rows) {                                                                    \
    double *dy_sum = malloc(2 * channels * sizeof(double)), *dot = dy_sum + channels;                             \
    if (!dy_sum) return -1;                                                                                       \
    for (int64_t c = 0; c < channels; ++c) dy_sum[c] = dot[c] = 0;                                                \
    SUM_ROWS(dy_sum, (double)load_##NAME(dy[k]))                                                                  \
    SUM_ROWS(dot, (double)load_##NAME(dy[k]) * ((double)load_##NAME(x[k]) - (double)mean[c]))                     \
    for (int64_t c = 0; c < channels; ++c) {                                                                      \
        sum_dy[c] = (T)dy_sum[c];                                                                                 \
        sum_dy_xhat[c] = (T)(dot[c] * (double)((T)1 / SQRT(var[c] + (T)eps)));                                    \
    }                                                                                                             \
    free(dy_sum);                                                                                                 \
    syncbn_stage_##COMPUTE(sum_dy, sum_dy_xhat, channels, total, rows);                                           \
    return 0;                                                                                                     \
}                                                                                                                 \
                                                                                                                  \
/* Backward after the sum: syncbn_coefficients_'s [gamma, alpha', s], then dx = x alpha + beta + s dy with alpha = \
 * alpha' invstd, beta = gamma - mean alpha (BatchNorm's inference kernel with weight alpha', bias gamma). */     \
int64_t syncbn_input_grad_##NAME(const S *dy, const S *x, const T *rows, const T *weight, const T *mean,         \
                                 const T *var, double eps, int64_t batch, int64_t channels, S *dx) {              \
    T *coefficients = malloc(3 * channels * sizeof(T));                                                           \
    if (!coefficients) return -1;                                                                                 \
    syncbn_coefficients_##COMPUTE(rows, weight, var, eps, channels, coefficients);                                \
    T *beta = coefficients, *alpha = coefficients + channels, *scale = coefficients + 2 * channels;               \
    for (int64_t c = 0; c < channels; ++c) {                                                                      \
        alpha[c] = alpha[c] * ((T)1 / SQRT(var[c] + (T)eps));                                                     \
        beta[c] = beta[c] - mean[c] * alpha[c];                                                                   \
    }                                                                                                             \
    for (int64_t i = 0; i < batch; ++i)                                                                           \
        for (int64_t c = 0, k = i * channels; c < channels; ++c, ++k)                                             \
            dx[k] = store_##NAME((load_##NAME(x[k]) * alpha[c] + beta[c]) + load_##NAME(dy[k]) * scale[c]);       \
    free(coefficients);                                                                                           \
    return 0;                                                                                                     \
}

WHOLE_FUNCTIONS(float, float, float32, float32, sqrtf)
WHOLE_FUNCTIONS(double, double, float64, float64, sqrt)
WHOLE_FUNCTIONS(uint16_t, float, bfloat16, float32, sqrtf)

/* float16 in integer and float operations that vectorize (the conversions of the FP16 library, as c10::Half's):
 * exact both ways, rounding to nearest, ties to even; subnormals, infinities and NaN kept. */
static inline float bits_to_float(uint32_t bits) { float f; memcpy(&f, &bits, sizeof f); return f; }
static inline uint32_t float_to_bits(float f) { uint32_t bits; memcpy(&bits, &f, sizeof bits); return bits; }
static inline float load_float16(uint16_t v) {
    const uint32_t w = (uint32_t)v << 16, sign = w & 0x80000000u, two_w = w + w;
    const float normalized = bits_to_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = bits_to_float((two_w >> 17) | (126u << 23)) - 0.5f;
    return bits_to_float(sign | float_to_bits(two_w < (1u << 27) ? denormalized : normalized));
}
static inline uint16_t store_float16(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = float_to_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = bits_to_float((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = float_to_bits(base), nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

WHOLE_FUNCTIONS(uint16_t, float, float16, float32, sqrtf)

/* The conversions above over n values, for the tests that hold them to PyTorch's on every 16-bit pattern. */
#define CONVERSIONS(NAME)                                                                                         \
void syncbn_from_##NAME(const uint16_t *in, float *out, int64_t n) {                                              \
    for (int64_t i = 0; i < n; ++i) out[i] = load_##NAME(in[i]);                                                  \
}                                                                                                                 \
void syncbn_to_##NAME(const float *in, uint16_t *out, int64_t n) {                                                \
    for (int64_t i = 0; i < n; ++i) out[i] = store_##NAME(in[i]);                                                 \
}
CONVERSIONS(float16)
CONVERSIONS(bfloat16)
