/* Coverage for fuzzing the native engine with libFuzzer (as bundled in atheris) when only gcc
 * is available: gcc's -fsanitize-coverage=trace-pc calls __sanitizer_cov_trace_pc() in every
 * basic block; this bumps an 8-bit counter per (hashed) program counter, in a table handed to
 * libFuzzer with __sanitizer_cov_8bit_counters_init, which is what clang's inline 8-bit
 * counters do. gcc's trace-cmp hooks go to libFuzzer directly. Built only by the fuzz test
 * (tests/comm/fuzz_native.py), never into the installed extension. */
#include <stdint.h>

#define COUNTERS (1 << 16)
static uint8_t counters[COUNTERS];


__attribute__((visibility("hidden"))) void __sanitizer_cov_trace_pc(void) {
    uintptr_t pc = (uintptr_t)__builtin_return_address(0);
    counters[(pc ^ (pc >> 15)) & (COUNTERS - 1)]++;
}

/* called by the harness with libFuzzer's __sanitizer_cov_8bit_counters_init, looked up in
 * atheris' own library: under AddressSanitizer the preloaded runtime defines (inert) versions
 * of the coverage entry points that would otherwise win symbol resolution */
void stw_fuzz_register(void (*init)(uint8_t *, uint8_t *)) {
    init(counters, counters + COUNTERS);
}

/* gcc's trace-cmp also reports float comparisons, which libFuzzer has no hooks for */
__attribute__((visibility("hidden"))) void __sanitizer_cov_trace_cmpf(float a, float b) {
    (void)a; (void)b;
}
__attribute__((visibility("hidden"))) void __sanitizer_cov_trace_cmpd(double a, double b) {
    (void)a; (void)b;
}
