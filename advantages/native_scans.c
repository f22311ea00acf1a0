/* The carry-through return scans on the CPU, one pass right to left (advantages/native_scans.py).
 *
 * Row-major (rows, cols) arrays of one float type T; steps holds the ASSISTANT mask as 0/1 in T.
 * The running state is a double, so long rows lose nothing to float32 rounding (as the serial
 * reference in tests/helpers/reference_returns.py, which works in Python floats). Off the steps the state
 * is carried (an OBSERVATION, or a PAD, which only trails a row, where the state is still 0) and
 * the outputs are exactly 0. Four rows are scanned together: each row's recurrence is a chain of
 * dependent multiply-adds, and four independent chains keep the core busy.
 *
 * whitened_*: after each group of rows is scanned, the moments of the values it wrote (the
 * returns, or GAE's advantages) are summed per row while the rows are still in the cache, in
 * double and less a shift (the row's first value, so the squares do not cancel when the mean
 * dwarfs the spread); rows are merged by Chan's formula, and one more pass writes the whitened
 * values, (v - mean) / sqrt(var + eps) on the steps (verl's masked_whiten, Bessel-corrected), 0
 * elsewhere. Fewer than 2 steps have no variance: the scale is 0, so the output is 0 everywhere
 * (advantages/stats.py says why; the callers' validation raises there, as verl does). */
#include <math.h>
#include <stdint.h>

#define ROWS 4

/* The moments and whitening loops are compiled for AVX-512, AVX2 and plain x86-64, picked at load
 * time (native_simd.h, in masking/). Not the scans: their steps are scalar (a chain of dependent
 * multiply-adds per row), and they ran slower as AVX-512 code (BENCHMARKS.md, issue 20). */
#include "native_simd.h"

/* a row's moments: count, shift, and the sums of (value - shift) and of its square */
typedef struct {
    double n, shift, sum, squares;
} moments;

/* merges a row's moments into the batch's count, mean and sum of squared deviations (Chan et al.) */
static void merge(moments row, double *n, double *mean, double *m2) {
    if (row.n == 0) return;
    double row_mean = row.shift + row.sum / row.n, row_m2 = row.squares - row.sum * row.sum / row.n;
    double total = *n + row.n, delta = row_mean - *mean;
    *mean += delta * row.n / total;
    *m2 += row_m2 + delta * delta * *n * row.n / total;
    *n = total;
}

/* row_moments: the moments of a row's step values (0 off the steps); whiten: (values - mean) *
 * scale on the steps, 0 elsewhere, for a whole batch (out may be values) */
#define WHITENING(N, T)                                                                               \
    VECTOR_CLONES static moments row_moments_##N(const T *values, const T *steps, int64_t cols) {     \
        double shift = 0, n = 0, sum = 0, squares = 0;                                                \
        for (int64_t j = 0; j < cols; j++)                                                            \
            if (steps[j] != 0) {                                                                      \
                shift = values[j];                                                                    \
                break;                                                                                \
            }                                                                                         \
        _Pragma("omp simd reduction(+ : n, sum, squares)")                                            \
        for (int64_t j = 0; j < cols; j++) {                                                          \
            double d = steps[j] != 0 ? (double)values[j] - shift : 0.0;                               \
            n += steps[j] != 0 ? 1.0 : 0.0, sum += d, squares += d * d;                               \
        }                                                                                             \
        moments m = {n, shift, sum, squares};                                                         \
        return m;                                                                                     \
    }                                                                                                 \
    VECTOR_CLONES static void whiten_##N(const T *values, const T *steps, T *out, int64_t size,       \
                                         double n, double mean, double m2, double eps) {              \
        /* Bessel-corrected; below 2 steps scale 0: 0 everywhere (a single step's centred value is 0) */ \
        double scale = n < 2 ? 0.0 : 1.0 / sqrt(m2 / (n - 1) + eps);                                  \
        for (int64_t i = 0; i < size; i++) {                                                          \
            T whitened = (T)(((double)values[i] - mean) * scale);                                     \
            out[i] = steps[i] != 0 ? whitened : (T)0;                                                 \
        }                                                                                             \
    }

/* returns: R = x + gamma R on a step (returned), carried elsewhere (0 returned); rows at base[k],
 * each starting from state[k], which is left holding the state at the row's start (column 0) */
#define RETURNS(N, T)                                                                                 \
    static void returns_rows_##N(const T *x, const T *steps, T *out, const int64_t *base_in,          \
                                 int64_t group, int64_t cols, double gamma, double *state_in) {        \
        int64_t base[ROWS];                                                                           \
        double state[ROWS];                                                                           \
        for (int64_t k = 0; k < group; k++) base[k] = base_in[k], state[k] = state_in[k];             \
        for (int64_t j = cols - 1; j >= 0; j--) {                                                     \
            for (int64_t k = 0; k < group; k++) {                                                     \
                int64_t at = base[k] + j;                                                             \
                int on = steps[at] != 0;                                                              \
                state[k] = on ? x[at] + gamma * state[k] : state[k];                                  \
                out[at] = on ? (T)state[k] : (T)0;                                                    \
            }                                                                                         \
        }                                                                                             \
        for (int64_t k = 0; k < group; k++) state_in[k] = state[k];                                   \
    }                                                                                                 \
    static void returns_group_##N(const T *x, const T *steps, T *out, int64_t group, int64_t cols,    \
                                  double gamma) {                                                     \
        int64_t base[ROWS] = {0, cols, 2 * cols, 3 * cols};                                           \
        double state[ROWS] = {0};                                                                     \
        returns_rows_##N(x, steps, out, base, group, cols, gamma, state);                             \
    }                                                                                                 \
    void returns_##N(const T *x, const T *steps, T *out, int64_t rows, int64_t cols, double gamma) {  \
        for (int64_t first = 0; first < rows; first += ROWS) {                                        \
            int64_t at = first * cols, group = rows - first < ROWS ? rows - first : ROWS;             \
            returns_group_##N(x + at, steps + at, out + at, group, cols, gamma);                      \
        }                                                                                             \
    }                                                                                                 \
    void whitened_returns_##N(const T *x, const T *steps, T *returns, T *advantages, int64_t rows,    \
                              int64_t cols, double gamma, double eps) {                               \
        double n = 0, mean = 0, m2 = 0;                                                               \
        for (int64_t first = 0; first < rows; first += ROWS) {                                        \
            int64_t at = first * cols, group = rows - first < ROWS ? rows - first : ROWS;             \
            returns_group_##N(x + at, steps + at, returns + at, group, cols, gamma);                  \
            for (int64_t row = at; row < at + group * cols; row += cols)                              \
                merge(row_moments_##N(returns + row, steps + row, cols), &n, &mean, &m2);             \
        }                                                                                             \
        whiten_##N(returns, steps, advantages, rows * cols, n, mean, m2, eps);                        \
    }                                                                                                 \
    /* chained: rows are segments of sessions; each row starts from the state its session's next     \
     * segment (row next[row], or none: -1) ended with, as if the two were one row (CHAIN below);    \
     * eps >= 0 also whitens into advantages */                                                       \
    void chained_returns_##N(const T *x, const T *steps, T *returns, T *advantages, int64_t rows,     \
                             int64_t cols, double gamma, double eps, const int64_t *order,            \
                             const int64_t *next, const int64_t *level, double *carry) {              \
        double n = 0, mean = 0, m2 = 0;                                                               \
        for (int64_t first = 0; first < rows;) {                                                      \
            int64_t base[ROWS], group;                                                                \
            double state[ROWS];                                                                       \
            CHAIN_GROUP(first, group, base, state, 1, cols, rows, order, next, level, carry);         \
            returns_rows_##N(x, steps, returns, base, group, cols, gamma, state);                     \
            for (int64_t k = 0; k < group; k++) {                                                     \
                carry[order[first + k]] = state[k];                                                   \
                if (eps >= 0) merge(row_moments_##N(returns + base[k], steps + base[k], cols), &n, &mean, &m2); \
            }                                                                                         \
            first += group;                                                                           \
        }                                                                                             \
        if (eps >= 0) whiten_##N(returns, steps, advantages, rows * cols, n, mean, m2, eps);          \
    }

/* GAE: on a step delta = r + gamma V_next - V, A = delta + gamma lam A, V_next = V; A and A + V
 * returned; both carried elsewhere (0 returned); rows at base[k], each starting from (A, V_next) =
 * state[2k], state[2k + 1], which are left holding the state at the row's start */
#define GAE(N, T)                                                                                     \
    static void gae_rows_##N(const T *rewards, const T *values, const T *steps, T *advantages,        \
                             T *returns, const int64_t *base_in, int64_t group, int64_t cols,         \
                             double gamma, double lam, double *state_in) {                            \
        int64_t base[ROWS];                                                                           \
        double running[ROWS], next_value[ROWS];                                                       \
        for (int64_t k = 0; k < group; k++)                                                           \
            base[k] = base_in[k], running[k] = state_in[2 * k], next_value[k] = state_in[2 * k + 1];  \
        for (int64_t j = cols - 1; j >= 0; j--) {                                                     \
            for (int64_t k = 0; k < group; k++) {                                                     \
                int64_t at = base[k] + j;                                                             \
                int on = steps[at] != 0;                                                              \
                double value = values[at];                                                            \
                double delta = rewards[at] + gamma * next_value[k] - value;                           \
                running[k] = on ? delta + gamma * lam * running[k] : running[k];                      \
                next_value[k] = on ? value : next_value[k];                                           \
                advantages[at] = on ? (T)running[k] : (T)0;                                           \
                returns[at] = on ? (T)(running[k] + value) : (T)0;                                    \
            }                                                                                         \
        }                                                                                             \
        for (int64_t k = 0; k < group; k++) state_in[2 * k] = running[k], state_in[2 * k + 1] = next_value[k]; \
    }                                                                                                 \
    static void gae_group_##N(const T *rewards, const T *values, const T *steps, T *advantages,       \
                              T *returns, int64_t group, int64_t cols, double gamma, double lam) {    \
        int64_t base[ROWS] = {0, cols, 2 * cols, 3 * cols};                                           \
        double state[2 * ROWS] = {0};                                                                 \
        gae_rows_##N(rewards, values, steps, advantages, returns, base, group, cols, gamma, lam, state); \
    }                                                                                                 \
    void gae_##N(const T *rewards, const T *values, const T *steps, T *advantages, T *returns,        \
                 int64_t rows, int64_t cols, double gamma, double lam) {                              \
        for (int64_t first = 0; first < rows; first += ROWS) {                                        \
            int64_t at = first * cols, group = rows - first < ROWS ? rows - first : ROWS;             \
            gae_group_##N(rewards + at, values + at, steps + at, advantages + at, returns + at,       \
                          group, cols, gamma, lam);                                                   \
        }                                                                                             \
    }                                                                                                 \
    /* the advantages are whitened in place */                                                        \
    void whitened_gae_##N(const T *rewards, const T *values, const T *steps, T *advantages,           \
                          T *returns, int64_t rows, int64_t cols, double gamma, double lam,           \
                          double eps) {                                                               \
        double n = 0, mean = 0, m2 = 0;                                                               \
        for (int64_t first = 0; first < rows; first += ROWS) {                                        \
            int64_t at = first * cols, group = rows - first < ROWS ? rows - first : ROWS;             \
            gae_group_##N(rewards + at, values + at, steps + at, advantages + at, returns + at,       \
                          group, cols, gamma, lam);                                                   \
            for (int64_t row = at; row < at + group * cols; row += cols)                              \
                merge(row_moments_##N(advantages + row, steps + row, cols), &n, &mean, &m2);          \
        }                                                                                             \
        whiten_##N(advantages, steps, advantages, rows * cols, n, mean, m2, eps);                     \
    }                                                                                                 \
    /* chained as chained_returns; eps >= 0 whitens the advantages in place; carry is (rows, 2) */    \
    void chained_gae_##N(const T *rewards, const T *values, const T *steps, T *advantages,            \
                         T *returns, int64_t rows, int64_t cols, double gamma, double lam,            \
                         double eps, const int64_t *order, const int64_t *next, const int64_t *level, \
                         double *carry) {                                                             \
        double n = 0, mean = 0, m2 = 0;                                                               \
        for (int64_t first = 0; first < rows;) {                                                     \
            int64_t base[ROWS], group;                                                                \
            double state[2 * ROWS];                                                                   \
            CHAIN_GROUP(first, group, base, state, 2, cols, rows, order, next, level, carry);         \
            gae_rows_##N(rewards, values, steps, advantages, returns, base, group, cols, gamma, lam, state); \
            for (int64_t k = 0; k < group; k++) {                                                     \
                int64_t row = order[first + k];                                                       \
                carry[2 * row] = state[2 * k], carry[2 * row + 1] = state[2 * k + 1];                 \
                if (eps >= 0) merge(row_moments_##N(advantages + base[k], steps + base[k], cols), &n, &mean, &m2); \
            }                                                                                         \
            first += group;                                                                           \
        }                                                                                             \
        if (eps >= 0) whiten_##N(advantages, steps, advantages, rows * cols, n, mean, m2, eps);       \
    }

/* CHAIN_GROUP: the next group of rows of a chained scan. Rows go in order[] (every session's last
 * segments first: level[i], the segment number of order[i], never increases), up to ROWS rows of one
 * level together (so none waits on another of its group); row r starts from the WIDTH doubles its
 * session's next segment next[r] ended with (carry[WIDTH * next[r]..], already written: a higher
 * level), or from 0 for a session's last segment (next[r] = -1). Sets group, base[] and state[]. */
#define CHAIN_GROUP(first, group, base, state, WIDTH, cols, rows, order, next, level, carry)           \
    for (group = 0; group < ROWS && first + group < rows && level[first + group] == level[first]; group++) { \
        int64_t row_ = order[first + group], next_ = next[row_];                                      \
        base[group] = row_ * cols;                                                                    \
        for (int w_ = 0; w_ < WIDTH; w_++) state[WIDTH * group + w_] = next_ >= 0 ? carry[WIDTH * next_ + w_] : 0.0; \
    }

WHITENING(f32, float)
WHITENING(f64, double)
RETURNS(f32, float)
RETURNS(f64, double)
GAE(f32, float)
GAE(f64, double)
