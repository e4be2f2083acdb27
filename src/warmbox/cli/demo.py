"""``warmbox demo``: the README's first command ends here — one sandbox, each capability once."""

from __future__ import annotations

import asyncio
import time


async def demo() -> int:
    from warmbox import Limits
    from warmbox.engine.engine import Engine
    from warmbox.sdk.sandbox import AsyncSandbox

    for row in Engine.for_home().doctor():
        print(f"  tier {row.tier:<10} {'available' if row.available else 'unavailable'}: {row.reason}")
    t0 = time.perf_counter()
    async with await AsyncSandbox.create(
        tier="container", timeout=120, envs={"GREETING": "hi"}, limits=Limits(memory_mb=512, cpus=1.0, pids=256)
    ) as sb:
        r = await sb.commands.run("python3 -c 'print(2 + 2)'")
        print(
            f"sandbox {sb.sandbox_id} answered {r.stdout.strip()!r} "
            f"{(time.perf_counter() - t0) * 1e3:.0f} ms after create was called"
        )
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
    print("sandbox destroyed")
    engine = Engine.for_home()
    pool = engine.settings().pool_for("container", "base", Limits())
    if pool is not None:  # the create above missed the pool; a miss grows it
        engine.ensure_daemon()
        deadline = time.monotonic() + 30
        while engine.registry.pools.pool_counts(pool.name)[0] < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        t0 = time.perf_counter()
        async with await AsyncSandbox.create(tier="container", timeout=120) as sb:
            e = await sb.run_code("print(2 + 2)")
            ms = (time.perf_counter() - t0) * 1e3
            print(
                f"warm pool {pool.name!r}: from_pool={sb.from_pool}, answered {e.stdout.strip()!r} {ms:.1f} ms "
                f"after create was called"
            )
            print(
                "  stage timings (ms, [done by the pool beforehand]):",
                " ".join(
                    f"{t.stage}={t.duration_ms:.1f}" if t.on_request_path else f"[{t.stage}={t.duration_ms:.1f}]"
                    for t in sb.stage_timings
                ),
            )
        m = await sb.metrics()
        print(
            f"  metered: cpu {m.cpu_s:.3f} s, memory {m.memory_gib_s:.4f} GiB-s, wall {m.wall_s:.2f} s, "
            f"idle {m.idle_s:.2f} s (warm-up billed to the pool; see warmbox pool ls)"
        )
    print("try: warmbox run -- python3 -c 'print(2+2)'; warmbox pool ls; warmbox down")
    return 0
