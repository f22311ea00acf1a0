/* VECTOR_CLONES: compile a loop for AVX-512 (x86-64-v4), AVX2 and plain x86-64, the CPU's best
 * picked at load time, so no -march=native is needed and a shared cache stays safe (the C files of
 * masking/native.py include this header; the loader hashes it with each source). GCC 12 is the
 * first to clone for x86-64-v4; clang and older GCC get AVX2 and plain clones; elsewhere none. */
#ifndef AGENT_LOOP_NATIVE_SIMD_H
#define AGENT_LOOP_NATIVE_SIMD_H

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#elif defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef VECTOR_CLONES
#define VECTOR_CLONES
#endif

#endif
