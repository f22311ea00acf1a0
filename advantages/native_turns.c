/* The turn-level estimators' token passes on the CPU (advantages/native_turns.py, issue 47).
 *
 * Row-major (rows, cols) arrays. spans: int8 SpanKind (0 PAD, 1 ASSISTANT, 2 OBSERVATION).
 * turn_ids: int16 or int64 (turn_kind 2 or 8), or absent (turn_kind 0: the k-th ASSISTANT run of a
 * row is turn k). An OBSERVATION token precedes turn (the last ASSISTANT turn before it) + 1, 0
 * before the first, as the torch path reads turn_ids + 1 there (validated turn ids agree).
 *
 * turn_tables: one pass, per (row, turn k < n): r = the sum of the rewards on turn k's ASSISTANT
 * tokens (in double, in token order), v = values at turn k's first ASSISTANT token (optional), and
 * two polynomial hashes (bases B1, B2 mod the Mersenne prime 2^61 - 1, 128-bit products) of the
 * token ids + 1 of the OBSERVATION tokens before turn k, in order: h = h * B + (x + 1) mod p.
 * turn_broadcast: per token, a (rows, n) double table's value at the token's turn on ASSISTANT
 * tokens, exactly 0 elsewhere, in the output's type. Turn ids outside [0, n) are skipped. */
#include <stdint.h>
#include <string.h>

#define P61 0x1FFFFFFFFFFFFFFFULL
#define B1 1000003ULL
#define B2 911382323ULL

static inline uint64_t mulmod61(uint64_t a, uint64_t b) {
    __uint128_t z = (__uint128_t)a * b;
    uint64_t s = ((uint64_t)z & P61) + (uint64_t)(z >> 61);
    return s >= P61 ? s - P61 : s;
}

static inline uint64_t addmod61(uint64_t a, uint64_t b) {
    uint64_t s = a + b;
    return s >= P61 ? s - P61 : s;
}

static inline int64_t turn_at(const void *turn_ids, int turn_kind, int64_t i) {
    return turn_kind == 2 ? ((const int16_t *)turn_ids)[i] : ((const int64_t *)turn_ids)[i];
}

/* count[row] = the number of turns (largest ASSISTANT turn id + 1, or the number of runs) */
void turn_counts(const int8_t *spans, const void *turn_ids, int turn_kind, int64_t rows, int64_t cols, int64_t *count) {
    for (int64_t row = 0; row < rows; row++) {
        const int8_t *s = spans + row * cols;
        int64_t c = 0;
        int previous = 0;
        for (int64_t t = 0; t < cols; t++) {
            int a = s[t] == 1;
            if (a) {
                if (turn_kind) {
                    int64_t k = turn_at(turn_ids, turn_kind, row * cols + t) + 1;
                    if (k > c) c = k;
                } else if (!previous) {
                    c++;
                }
            }
            previous = a;
        }
        count[row] = c;
    }
}

#define TABLES(NAME, T)                                                                              \
    void NAME(const T *rewards, const T *values, const int8_t *spans, const void *turn_ids, int turn_kind, \
              const int64_t *tokens, int64_t rows, int64_t cols, int64_t n, double *r, double *v,    \
              int64_t *h1, int64_t *h2) {                                                            \
        memset(r, 0, sizeof(double) * rows * n);                                                     \
        if (v) memset(v, 0, sizeof(double) * rows * n);                                              \
        if (tokens) { memset(h1, 0, sizeof(int64_t) * rows * n); memset(h2, 0, sizeof(int64_t) * rows * n); } \
        for (int64_t row = 0; row < rows; row++) {                                                   \
            const int64_t base = row * cols;                                                         \
            double *rr = r + row * n;                                                                \
            int64_t last = -1, seen = -1; /* the last ASSISTANT turn, the last turn whose v is set */ \
            uint64_t a = 0, b = 0;         /* the hashes of the observation being read */            \
            int64_t into = 0;              /* the turn it precedes */                                \
            int previous = 0;                                                                        \
            for (int64_t t = 0; t < cols; t++) {                                                     \
                const int8_t s = spans[base + t];                                                    \
                if (s == 1) {                                                                        \
                    int64_t k = turn_kind ? turn_at(turn_ids, turn_kind, base + t)                   \
                                          : (previous ? last : last + 1);                            \
                    if (k >= 0 && k < n) {                                                           \
                        rr[k] += (double)rewards[base + t];                                          \
                        if (v && k != seen) v[row * n + k] = (double)values[base + t];               \
                        seen = k;                                                                    \
                    }                                                                                \
                    last = k;                                                                        \
                    previous = 1;                                                                    \
                } else {                                                                             \
                    previous = 0;                                                                    \
                    if (s == 2 && tokens) {                                                          \
                        int64_t k = last + 1;                                                        \
                        if (k != into) { /* a new observation (the one before turn k) */             \
                            if (into >= 0 && into < n) { h1[row * n + into] = (int64_t)a; h2[row * n + into] = (int64_t)b; } \
                            into = k;                                                                \
                            a = b = 0;                                                               \
                            if (k >= 0 && k < n) { a = (uint64_t)h1[row * n + k]; b = (uint64_t)h2[row * n + k]; } \
                        }                                                                            \
                        uint64_t x = ((uint64_t)tokens[base + t] + 1) % P61;                         \
                        a = addmod61(mulmod61(a, B1), x);                                            \
                        b = addmod61(mulmod61(b, B2), x);                                            \
                    }                                                                                \
                }                                                                                    \
            }                                                                                        \
            if (tokens && into >= 0 && into < n) { h1[row * n + into] = (int64_t)a; h2[row * n + into] = (int64_t)b; } \
        }                                                                                            \
    }

#define BROADCAST(NAME, T)                                                                           \
    void NAME(const double *table, const int8_t *spans, const void *turn_ids, int turn_kind, int64_t rows, \
              int64_t cols, int64_t n, T *out) {                                                     \
        for (int64_t row = 0; row < rows; row++) {                                                   \
            const int64_t base = row * cols;                                                         \
            const double *tr = table + row * n;                                                      \
            int64_t last = -1;                                                                       \
            int previous = 0;                                                                        \
            for (int64_t t = 0; t < cols; t++) {                                                     \
                T value = 0;                                                                         \
                if (spans[base + t] == 1) {                                                          \
                    int64_t k = turn_kind ? turn_at(turn_ids, turn_kind, base + t) : (previous ? last : last + 1); \
                    if (k >= 0 && k < n) value = (T)tr[k];                                           \
                    last = k;                                                                        \
                    previous = 1;                                                                    \
                } else {                                                                             \
                    previous = 0;                                                                    \
                }                                                                                    \
                out[base + t] = value;                                                               \
            }                                                                                        \
        }                                                                                            \
    }

TABLES(turn_tables_f32, float)
TABLES(turn_tables_f64, double)
BROADCAST(turn_broadcast_f32, float)
BROADCAST(turn_broadcast_f64, double)
