"""``warmbox demo``: the README's first command ends here — one sandbox, each capability once."""

from __future__ import annotations

import time


async def demo() -> int:
    from warmbox import Limits
    from warmbox.engine.engine import Engine
    from warmbox.sdk.sandbox import AsyncSandbox

    for row in Engine.for_home().doctor():
        print(f"  tier {row.tier:<10} {'available' if row.available else 'unavailable'}: {row.reason}")
    t0 = time.perf_counter()
    async with await AsyncSandbox.create("container", timeout=120, envs={"GREETING": "hi"},
                                         limits=Limits(memory_mb=512, cpus=1.0, pids=256)) as sb:
        r = await sb.commands.run("python3 -c 'print(2 + 2)'")
        print(f"sandbox {sb.sandbox_id} answered {r.stdout.strip()!r} "
              f"{(time.perf_counter() - t0) * 1e3:.0f} ms after create was called")
        print("  stage timings (ms):", ", ".join(f"{k}={v:.1f}" for k, v in sb.timings.items()))
        r = await sb.commands.run("id -u; echo $GREETING; cat /proc/self/status | grep CapEff")
        print("  inside:", " | ".join(r.stdout.split("\n")[:3]))
        await sb.run_code("import math; x = 41")
        e = await sb.run_code("x + 1")
        print(f"  stateful code context: x + 1 = {e.text}")
        await sb.files.write("/workspace/a.txt", "data")
        print(f"  files: /workspace/a.txt = {await sb.files.read('/workspace/a.txt')!r}")
        r = await sb.commands.run("sleep 1000", timeout=0.5)
        print(f"  timeout: timed_out={r.timed_out} after {r.duration_ms:.0f} ms")
        r = await sb.commands.run("cat /etc/shadow; touch /usr/x", timeout=5)
        print(f"  isolation: {r.stderr.strip().splitlines()[-1]}")
    print("sandbox destroyed; try: warmbox run -- python3 -c 'print(2+2)'")
    return 0
