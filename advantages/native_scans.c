/* The carry-through return scans on the CPU, one pass right to left (advantages/native_scans.py).
 *
 * Row-major (rows, cols) arrays of one float type T; steps holds the ASSISTANT mask as 0/1 in T.
 * The running state is a double, so long rows lose nothing to float32 rounding (as the serial
 * reference in tests/reference_returns.py, which works in Python floats). Off the steps the state
 * is carried (an OBSERVATION, or a PAD, which only trails a row, where the state is still 0) and
 * the outputs are exactly 0. Four rows are scanned together: each row's recurrence is a chain of
 * dependent multiply-adds, and four independent chains keep the core busy. */
#include <stdint.h>

#define ROWS 4

/* returns: R = x + gamma R on a step (returned), carried elsewhere (0 returned) */
#define RETURNS(NAME, T)                                                                              \
    void NAME(const T *x, const T *steps, T *out, int64_t rows, int64_t cols, double gamma) {        \
        for (int64_t first = 0; first < rows; first += ROWS) {                                        \
            int64_t group = rows - first < ROWS ? rows - first : ROWS;                                \
            double state[ROWS] = {0};                                                                 \
            for (int64_t j = cols - 1; j >= 0; j--) {                                                 \
                for (int64_t k = 0; k < group; k++) {                                                 \
                    int64_t at = (first + k) * cols + j;                                              \
                    int on = steps[at] != 0;                                                          \
                    state[k] = on ? x[at] + gamma * state[k] : state[k];                              \
                    out[at] = on ? (T)state[k] : (T)0;                                                \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
    }

/* GAE: on a step delta = r + gamma V_next - V, A = delta + gamma lam A, V_next = V; A and A + V
 * returned; both carried elsewhere (0 returned) */
#define GAE(NAME, T)                                                                                  \
    void NAME(const T *rewards, const T *values, const T *steps, T *advantages, T *returns,          \
              int64_t rows, int64_t cols, double gamma, double lam) {                                 \
        for (int64_t first = 0; first < rows; first += ROWS) {                                        \
            int64_t group = rows - first < ROWS ? rows - first : ROWS;                                \
            double running[ROWS] = {0}, next_value[ROWS] = {0};                                       \
            for (int64_t j = cols - 1; j >= 0; j--) {                                                 \
                for (int64_t k = 0; k < group; k++) {                                                 \
                    int64_t at = (first + k) * cols + j;                                              \
                    int on = steps[at] != 0;                                                          \
                    double value = values[at];                                                        \
                    double delta = rewards[at] + gamma * next_value[k] - value;                       \
                    running[k] = on ? delta + gamma * lam * running[k] : running[k];                  \
                    next_value[k] = on ? value : next_value[k];                                       \
                    advantages[at] = on ? (T)running[k] : (T)0;                                       \
                    returns[at] = on ? (T)(running[k] + value) : (T)0;                                \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
    }

RETURNS(returns_f32, float)
RETURNS(returns_f64, double)
GAE(gae_f32, float)
GAE(gae_f64, double)
