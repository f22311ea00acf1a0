/* validate_batch's checks in one pass over a batch's rewards, mask and spans (masking/native_checks.py).
 *
 * One function per (rewards, mask) element type: check_<rewards>_<mask>. Row-major (rows, cols)
 * arrays; spans are SpanKind bytes (PAD 0, ASSISTANT 1, OBSERVATION 2; an int8 -1 reads as 255),
 * or NULL for a mask-only batch, where every 0 of the mask is an OBSERVATION. Returns 1 when any
 * check fails (the caller then runs the single checks for the message) and writes the number of
 * ASSISTANT tokens to *count.
 *
 * Speed: failures are or-ed without branches, a row's bytes and its floats are read in separate
 * loops, and counts are per-row int32, so the compiler vectorises every loop; on x86-64 an AVX2
 * clone is chosen at load time when the CPU has it. Compile without -ffast-math: `r - r != 0` is
 * the test for NaN and inf. */
#include <stdint.h>

#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef VECTOR_CLONES
#define VECTOR_CLONES
#endif

#define CHECK(NAME, R, M)                                                                             \
    VECTOR_CLONES int NAME(const R *rewards, const M *mask, const uint8_t *spans, int64_t rows,       \
                           int64_t cols, int64_t *count) {                                            \
        int64_t n = 0;                                                                                \
        int bad = 0;                                                                                  \
        for (int64_t i = 0; i < rows; i++) {                                                          \
            const R *r = rewards + i * cols;                                                          \
            const M *m = mask + i * cols;                                                             \
            int32_t row_count = 0, row_bad = 0;                                                       \
            uint8_t span_bad = 0; /* bytes or-ed in bytes: no widening in the span loops */           \
            if (spans) {                                                                              \
                const uint8_t *s = spans + i * cols;                                                  \
                for (int64_t j = 0; j + 1 < cols; j++) /* known spans; PAD only trails */             \
                    span_bad |= (s[j] > 2) | ((s[j] == 0) & (s[j + 1] != 0));                         \
                span_bad |= s[cols - 1] > 2;                                                          \
                for (int64_t j = 0; j < cols; j++) row_count += s[j] == 1;                            \
                for (int64_t j = 0; j < cols; j++) { /* mask == ASSISTANT; finite rewards, 0 off it */ \
                    R off = s[j] != 1; /* in the rewards' type: one vector width for the loop */      \
                    row_bad |= (m[j] != (M)(1 - off)) | (r[j] - r[j] != 0) | (r[j] * off != 0);       \
                }                                                                                     \
            } else {                                                                                  \
                for (int64_t j = 0; j < cols; j++) { /* a 0/1 mask; finite rewards, 0 where it is 0 */ \
                    int32_t on = m[j] == 1;                                                           \
                    row_bad |= (!on & (m[j] != 0)) | (r[j] - r[j] != 0) | (!on & (r[j] != 0));        \
                    row_count += on;                                                                  \
                }                                                                                     \
            }                                                                                         \
            n += row_count;                                                                           \
            bad |= row_bad | span_bad;                                                                \
        }                                                                                             \
        *count = n;                                                                                   \
        return bad;                                                                                   \
    }

#define FOR_MASKS(R, RN)               \
    CHECK(check_##RN##_f32, R, float)  \
    CHECK(check_##RN##_f64, R, double) \
    CHECK(check_##RN##_u8, R, uint8_t) \
    CHECK(check_##RN##_i8, R, int8_t)  \
    CHECK(check_##RN##_i32, R, int32_t) \
    CHECK(check_##RN##_i64, R, int64_t)

FOR_MASKS(float, f32)
FOR_MASKS(double, f64)
