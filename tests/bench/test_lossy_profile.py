"""The per-stage CPU account of `stalwart bench lossy --only profile`: perf samples are
classified by the thread and the function they landed in, and every sampled nanosecond is in
exactly one stage (the kernel-copy row is a part of the syscall rows, not counted twice)."""

from __future__ import annotations

from stalwart.bench import lossy_profile as lp

SCRIPT = """python 100/100 100000:
\tffffffff81 rep_movs_alternative+0x1 ([kernel.kallsyms])
\tffffffff82 __sys_sendmmsg+0x1 ([kernel.kallsyms])
\t7f00 sendmmsg+0x1 (/usr/lib/x86_64-linux-gnu/libc.so.6)

stw-rx 100/101 300000:
\t7f01 sum_into+0x5 (/x/_stwnative.cpython-311-x86_64-linux-gnu.so)

stw-rx 100/101 100000:
\tffffffff83 _raw_spin_lock+0x1 ([kernel.kallsyms])
\tffffffff84 __sys_recvmmsg+0x1 ([kernel.kallsyms])

stw-rx 100/101 100000:
\t7f02 [unknown] (/usr/lib/x86_64-linux-gnu/libcrypto.so.3)

pt_gloo 100/102 100000:
\t7f03 void gloo::sum<float>(void*, void const*, unsigned long)+0x3 (/t/libtorch_cpu.so)

python 100/100 100000:
\t7f04 ec_encode_data_avx2+0x9 (/p/libisal.so.2)
"""


def test_each_sample_is_in_one_stage_by_thread_and_function() -> None:
    c = lp.classify(SCRIPT)
    assert c["main"] == {"syscalls: send": 100000, lp.KERNEL_COPY: 100000, "parity": 100000}
    assert c["rx"] == {"summation": 300000, "syscalls: receive": 100000,
                       "authentication": 100000}
    assert c["threads"] == {"summation": 100000}


def test_the_table_divides_by_payload_bytes_and_counts_each_ns_once() -> None:
    c = lp.classify(SCRIPT)
    rec = {"payload_bytes": 1000, "iters": 2, "ours": {"samples": c, "cpu_s": 8e-4},
           "gloo": {"samples": {"threads": {"summation": 400000}}, "cpu_s": 4e-4}}
    t = lp.table([rec, rec])  # two ranks
    ours = t["ours"]
    assert ours["all"]["total"] == 800000 * 2 / 4000  # ns over all ranks / bytes of all ranks
    assert ours["all"][lp.KERNEL_COPY] == 100000 * 2 / 4000
    assert abs(ours["covered"] - 1.0) < 1e-9
    assert t["gloo"]["all"] == {"summation": 200.0, "total": 200.0}
    md = lp.markdown(t, "x")
    assert "| authentication |" in md and "| total |" in md
