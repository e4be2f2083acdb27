// E2B's JavaScript SDKs against warmbox serve (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY in the
// environment; KEY_B: another tenant's key). Each check prints "ok <name>" or the script fails;
// tests/e2b/test_js_sdk.py runs it and reads the lines.
import { Sandbox, CommandExitError, NotFoundError } from '@e2b/code-interpreter'
import assert from 'node:assert/strict'

const ok = (name) => console.log(`ok ${name}`)
const sb = await Sandbox.create({ timeoutMs: 180_000, metadata: { lane: 'js' } })
let killed = false
try {
  // ---- commands: foreground, exit code, background with stdin, kill, list
  const fg = await sb.commands.run('echo hi; echo err >&2')
  assert.equal(fg.stdout, 'hi\n')
  assert.equal(fg.stderr, 'err\n')
  assert.equal(fg.exitCode, 0)
  ok('commands.foreground')
  await assert.rejects(sb.commands.run('exit 3'), (e) => e instanceof CommandExitError && e.exitCode === 3)
  ok('commands.exit_code')

  const cat = await sb.commands.run('cat', { background: true, stdin: true })
  assert.ok(cat.pid > 0)
  await sb.commands.sendStdin(cat.pid, 'typed in\n')
  await sb.commands.closeStdin(cat.pid)
  const catDone = await cat.wait()
  assert.equal(catDone.stdout, 'typed in\n')
  ok('commands.stdin')

  const sleeper = await sb.commands.run('sleep 300', { background: true })
  const listed = await sb.commands.list()
  assert.ok(listed.some((p) => p.pid === sleeper.pid), JSON.stringify(listed))
  ok('commands.list')
  assert.equal(await sb.commands.kill(sleeper.pid), true)
  await assert.rejects(sleeper.wait(), (e) => e instanceof CommandExitError)
  assert.ok(!(await sb.commands.list()).some((p) => p.pid === sleeper.pid))
  ok('commands.kill')

  // ---- files: write, read, list, info, rename, remove, exists
  await sb.files.write('notes/a.txt', 'alpha')
  assert.equal(await sb.files.read('notes/a.txt'), 'alpha')
  const bytes = await sb.files.read('notes/a.txt', { format: 'bytes' })
  assert.deepEqual(Array.from(bytes), Array.from(Buffer.from('alpha')))
  const entries = await sb.files.list('notes')
  assert.deepEqual(entries.map((e) => e.name), ['a.txt'])
  const info = await sb.files.getInfo('notes/a.txt')
  assert.equal(info.size, 5)
  assert.equal(info.path, '/home/user/notes/a.txt')
  await sb.files.rename('notes/a.txt', 'notes/b.txt')
  assert.equal(await sb.files.exists('notes/a.txt'), false)
  await sb.files.remove('notes/b.txt')
  assert.equal(await sb.files.exists('notes/b.txt'), false)
  await assert.rejects(sb.files.read('notes/none.txt'), (e) => e instanceof NotFoundError)
  ok('files')

  // ---- run_code: text, an error, a PNG chart
  const text = await sb.runCode('x = 21\nx * 2')
  assert.equal(text.text, '42')
  ok('run_code.text')
  const err = await sb.runCode('1 / 0')
  assert.equal(err.error.name, 'ZeroDivisionError')
  assert.match(err.error.traceback, /ZeroDivisionError/)
  ok('run_code.error')
  const chart = await sb.runCode('import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()')
  const png = chart.results.find((r) => r.png)
  assert.ok(png, JSON.stringify(chart.results.map((r) => Object.keys(r))))
  assert.equal(Buffer.from(png.png, 'base64').subarray(1, 4).toString(), 'PNG')
  ok('run_code.png')

  // ---- the tenant wall: another tenant's key finds nothing of this sandbox
  const keyB = process.env.KEY_B
  await assert.rejects(Sandbox.connect(sb.sandboxId, { apiKey: keyB }), (e) => e instanceof NotFoundError)
  assert.equal(await Sandbox.kill(sb.sandboxId, { apiKey: keyB }), false)
  const theirs = await Sandbox.list({ apiKey: keyB }).nextItems()
  assert.ok(!theirs.some((s) => s.sandboxId === sb.sandboxId))
  assert.equal(await sb.isRunning(), true)
  ok('tenant_wall')

  // ---- metrics history, a snapshot and a sandbox from it, a network update; B reaches none
  const metrics = await sb.getMetrics()
  assert.ok(metrics.length >= 1 && metrics[0].memUsed > 0 && metrics[0].cpuCount >= 1, JSON.stringify(metrics))
  const last = metrics[metrics.length - 1].timestamp
  assert.deepEqual((await sb.getMetrics({ start: last })).map((m) => m.timestamp.getTime()).slice(0, 1), [last.getTime()])
  await sb.files.write('snapped.txt', 'then')
  const snap = await sb.createSnapshot()
  assert.match(snap.snapshotId, /^snap-/)
  const fromSnap = await Sandbox.create(snap.snapshotId, { timeoutMs: 60_000 })
  try {
    assert.equal(await fromSnap.files.read('snapped.txt'), 'then')
  } finally {
    await fromSnap.kill()
  }
  assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId, { apiKey: keyB }), false)
  assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true)
  await sb.updateNetwork({ allowOut: ['example.com'] })
  await assert.rejects(Sandbox.updateNetwork(sb.sandboxId, {}, { apiKey: keyB }), (e) => e instanceof NotFoundError)
  await assert.rejects(Sandbox.getMetrics(sb.sandboxId, { apiKey: keyB }), (e) => e instanceof NotFoundError)
  ok('snapshot_metrics_network')

  // ---- pause, then connect: same id, files and the code context's state kept
  await sb.files.write('kept.txt', 'still here')
  assert.equal(await sb.betaPause(), true)
  const paused = await Sandbox.list({ query: { state: ['paused'] } }).nextItems()
  assert.ok(paused.some((s) => s.sandboxId === sb.sandboxId))
  const again = await Sandbox.connect(sb.sandboxId)
  assert.equal(again.sandboxId, sb.sandboxId)
  assert.equal(await again.files.read('kept.txt'), 'still here')
  assert.equal((await again.runCode('x')).text, '21')
  ok('pause_connect')

  // ---- kill
  assert.equal(await again.kill(), true)
  killed = true
  assert.equal(await Sandbox.kill(sb.sandboxId), false)
  await assert.rejects(Sandbox.connect(sb.sandboxId), (e) => e instanceof NotFoundError)
  ok('kill')
} finally {
  if (!killed) await Sandbox.kill(sb.sandboxId).catch(() => {})
}
console.log('done')
