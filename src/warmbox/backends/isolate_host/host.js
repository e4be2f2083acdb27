// The isolate host of Tier 1: one Node.js process holding one V8 isolate (isolated-vm) per sandbox.
//
// Started by backends/isolate.py inside an OS jail (runc: user, pid, mount, net, ipc, uts, cgroup
// namespaces, seccomp, no capabilities, its own memory-bounded cgroup). fd 3 is its control socket
// (listening; only the backend, as root, can reach its path): a control connection sends one JSON
// line, with a sandbox's listening socket as SCM_RIGHTS for "add" (received by fdpass.node), and
// gets one JSON line back. Each sandbox's socket speaks the guest wire protocol (protocol.py: u32
// header length, u32 body length, JSON header, raw body), so the engine's GuestSession talks to an
// isolate as to any guest agent: Ping, ContextCreate/Run/Delete/List/Restart, Configure, Reseed, GetUsage.
// Everything else is refused (Failure "invalid"): an isolate has no commands, files or ports.
//
// One host per tenant: a fault in one tenant's code (an OOM of the host, a crash) ends only that
// tenant's isolates. The host admits each isolate's memory_mb against its budget (WB_BUDGET_MB: its
// cgroup's memory minus what Node.js and the Wasm workers take): past it, "add" is refused with
// code "memory" (the backend raises LimitTooHigh). The control path never waits on user code: no
// synchronous call on a busy isolate, the fd receive never blocks the loop, and a socket error is
// handled (never the host's end). It exits on SIGTERM/SIGINT/SIGHUP, and when its home is deleted
// (fd 4: a root-owned empty file in the home, watched for a link count of 0).
//
// WebAssembly (run_code(..., language="wasm"): context "default-wasm") runs in wasm_worker.py
// processes this host starts inside the same jail (up to WB_WASM_WORKERS at once, one job each: a
// spinning module holds one worker, never the queue): fuel and epoch limits, memory capped at the
// sandbox's memory_mb less its isolate's heap, WASI without any preopened directory. A job still
// running WATCHDOG_MS past its timeout has its worker SIGKILLed (timed_out).
//
// Inside an isolate there is only ECMAScript (no require, process, fetch, Deno, import()), plus a
// console whose output is the run's stdout/stderr. Each isolate has a heap limit (the sandbox's
// memory_mb; ArrayBuffers count): a run that passes it ends with oom_kills=1, the isolate is
// disposed and a fresh one takes its place. Each run has a time limit (its timeout_s, at most
// MAX_RUN_S): a run past it is terminated (timed_out) and the isolate keeps its state; a run still
// going WATCHDOG_MS after that (isolated-vm's own timer did not end it) has its isolate disposed
// (timed_out; a fresh isolate takes its place), never the host.
'use strict';

const { spawn } = require('child_process');
const fs = require('fs');
const net = require('net');
const util = require('util');
const ivm = require(process.env.WB_IVM);
const fdpass = require(process.env.WB_FDPASS);

const PROTOCOL_VERSION = Number(process.env.WB_PROTOCOL_VERSION);
const MAX_HEADER = 1 << 20;
const MAX_BODY = 4 << 20;
const MAX_TEXT = 64 << 10;
const MAX_RUN_S = 3600; // a run without a timeout_s (0) is still bounded
const CONTROL_TIMEOUT_MS = 2000;
const MAX_SANDBOXES = Number(process.env.WB_MAX_SANDBOXES || 1024);
const BUDGET_MB = Number(process.env.WB_BUDGET_MB || 3584); // isolates' memory_mb together
const ISOLATE_OVERHEAD_MB = 2; // an isolate's own structures beside its heap limit
const WASM_WORKERS = Number(process.env.WB_WASM_WORKERS || 4);
const WATCHDOG_MS = 2000;
const ALIVE_FD = 4;
let reservedMb = 0;
const started = Date.now();

// the console inside every context: output goes to the host through one synchronous callback
const BOOTSTRAP = `(function () {
  const write = globalThis.__wb_write;
  delete globalThis.__wb_write;
  const seen = new WeakSet();
  function show(v, depth) {
    if (typeof v === 'string') return depth === 0 ? v : JSON.stringify(v);
    if (typeof v === 'function') return '[Function: ' + (v.name || '(anonymous)') + ']';
    if (typeof v === 'bigint') return String(v) + 'n';
    if (typeof v === 'symbol' || v === null || typeof v !== 'object') return String(v);
    if (v instanceof Error) return String(v.stack || v);
    if (seen.has(v) || depth > 2) return Array.isArray(v) ? '[Array]' : '[Object]';
    seen.add(v);
    try {
      if (Array.isArray(v)) return '[ ' + v.slice(0, 100).map((x) => show(x, depth + 1)).join(', ') + ' ]';
      const keys = Object.keys(v).slice(0, 100);
      return keys.length === 0 ? '{}' : '{ ' + keys.map((k) => k + ': ' + show(v[k], depth + 1)).join(', ') + ' }';
    } finally {
      seen.delete(v);
    }
  }
  const emit = (fd) => (...args) => { write(fd, args.map((a) => show(a, 0)).join(' ') + '\\n'); };
  globalThis.console = Object.freeze({
    log: emit(1), info: emit(1), debug: emit(1), trace: emit(2), warn: emit(2), error: emit(2),
  });
  return (v) => show(v, 1);
})()`;

// ---------------------------------------------------------------- WebAssembly

// wasmtime workers (wasm_worker.py, Python in this same jail), one job at a time each: a job takes
// an idle worker, or a new one up to WASM_WORKERS, or waits its turn. A job line in, a reply line
// out. A worker still busy WATCHDOG_MS past the job's timeout is SIGKILLed (its job timed out).
const idleWorkers = [];
const waitingJobs = [];
let liveWorkers = 0;
let nextJob = 1;

function newWorker() {
  const w = spawn('/usr/bin/python3', ['-I', '-S', '/opt/isolate-host/wasm_worker.py'], {
    stdio: ['pipe', 'pipe', 'inherit'],
    env: { PATH: '/usr/bin', WB_WASMTIME: process.env.WB_WASMTIME },
  });
  liveWorkers += 1;
  w.job = null;
  w.dead = false;
  let buf = '';
  w.stdout.setEncoding('utf8');
  w.stdout.on('data', (data) => {
    buf += data;
    let nl;
    while ((nl = buf.indexOf('\n')) >= 0) {
      const line = buf.slice(0, nl);
      buf = buf.slice(nl + 1);
      let reply;
      try {
        reply = JSON.parse(line);
      } catch (e) {
        continue;
      }
      const job = w.job;
      if (job !== null && reply !== null && reply.id === job.msg.id) {
        w.job = null;
        clearTimeout(job.timer);
        job.resolve(reply);
        idleWorkers.push(w);
        pumpWasm();
      }
    }
  });
  const gone = (code, signal) => {
    if (w.dead) return;
    w.dead = true;
    liveWorkers -= 1;
    const i = idleWorkers.indexOf(w);
    if (i >= 0) idleWorkers.splice(i, 1);
    const job = w.job;
    w.job = null;
    if (job !== null) {
      clearTimeout(job.timer);
      // SIGKILL: the watchdog; SIGXCPU: the job's CPU budget (RLIMIT_CPU, set by the worker)
      if (job.killed || signal === 'SIGXCPU') job.resolve({ timed_out: true, stdout: '', stderr: '', error_name: '', error_value: '' });
      else job.reject(new Error('the WebAssembly worker ended'));
    }
    pumpWasm();
  };
  w.on('exit', gone);
  w.on('error', gone);
  w.stdin.on('error', () => {});
  w.stdout.on('error', () => {});
  return w;
}

function pumpWasm() {
  while (waitingJobs.length > 0) {
    let w = idleWorkers.pop();
    if (w === undefined) {
      if (liveWorkers >= WASM_WORKERS) return;
      w = newWorker();
    }
    const job = waitingJobs.shift();
    w.job = job;
    const worker = w;
    job.timer = setTimeout(() => {
      job.killed = true;
      worker.kill('SIGKILL');
    }, job.limitMs + WATCHDOG_MS);
    w.stdin.write(JSON.stringify(job.msg) + '\n');
  }
}

function wasmRun(msg, limitMs) {
  return new Promise((resolve, reject) => {
    waitingJobs.push({ msg: { ...msg, id: nextJob++ }, limitMs, resolve, reject, timer: null, killed: false });
    pumpWasm();
  });
}

// ---------------------------------------------------------------- frames

function frame(sock, header, body) {
  const head = Buffer.from(JSON.stringify(header), 'utf8');
  const data = body || Buffer.alloc(0);
  const prefix = Buffer.alloc(8);
  prefix.writeUInt32BE(head.length, 0);
  prefix.writeUInt32BE(data.length, 4);
  if (!sock.destroyed) sock.write(Buffer.concat([prefix, head, data]));
}

function failure(sock, id, code, message) {
  frame(sock, { type: 'Failure', id, code, message: String(message).slice(0, MAX_TEXT) });
}

function bounded(text) {
  const s = String(text);
  return s.length > MAX_TEXT ? s.slice(0, MAX_TEXT) + '... [truncated]' : s;
}

// ---------------------------------------------------------------- sandboxes

class Sandbox {
  constructor(id, memoryMb) {
    this.id = id;
    this.memoryMb = memoryMb;
    this.server = null;
    this.conns = new Set();
    this.busyMs = 0;
    this.runs = 0;
    this.ooms = 0;
    this.chain = Promise.resolve(); // runs of one sandbox take turns (one isolate thread)
    this.run = null; // the run in progress: { sock, id, sent, max, truncated }
    this.nextContext = 1;
    this.wasm = { count: 0 }; // Wasm runs are stateless: each is a fresh wasmtime store
    this.isolate = null;
    this.contexts = new Map();
    this.busy = 0; // calls on the isolate's thread in progress: no synchronous call then
    this.heap = 0; // its last heap reading (bytes) and CPU time (ns): what usage answers while busy
    this.cpu = 0;
    this.killed = false; // the watchdog disposed its isolate
  }

  // heap and CPU readings, taken only while the isolate is idle (a synchronous call on a busy
  // isolate waits for its run: the control path must not)
  readings() {
    if (this.busy === 0 && this.isolate !== null && !this.isolate.isDisposed) {
      try {
        const s = this.isolate.getHeapStatisticsSync();
        this.heap = s.total_heap_size + s.externally_allocated_size;
        this.cpu = Number(this.isolate.cpuTime);
      } catch (e) {
        // disposed meanwhile: the last readings stand
      }
    }
    return { heap: this.heap, cpu: this.cpu };
  }

  // a new isolate with its default context: at start, and after an OOM disposed the last one. The
  // context is made and bootstrapped on the isolate's own thread (the host's loop serves the other
  // sandboxes meanwhile: a pool refill does not stall a claimed sandbox's run)
  async fresh() {
    this.isolate = new ivm.Isolate({ memoryLimit: this.memoryMb });
    this.contexts = new Map();
    this.killed = false;
    const { context } = this.contexts.get(await this.addContext('default-javascript'));
    // one run on the isolate's own thread now (a pooled sandbox's first snippet: ~0.15 ms, not ~0.25)
    this.busy += 1;
    try {
      await context.eval("(() => 'x'.toUpperCase())()", { timeout: 10000 });
    } finally {
      this.busy -= 1;
    }
  }

  async addContext(name) {
    this.busy += 1;
    try {
      const context = await this.isolate.createContext();
      const write = new ivm.Callback((fd, text) => this.output(fd === 2 ? 'Stderr' : 'Stdout', text), { sync: true });
      await context.global.set('__wb_write', write);
      const inspect = await context.eval(BOOTSTRAP, { reference: true, timeout: 10000 });
      this.contexts.set(name, { context, inspect, count: 0 });
      return name;
    } finally {
      this.busy -= 1;
    }
  }

  output(type, text) {
    const run = this.run;
    if (run === null) return;
    let data = Buffer.from(String(text), 'utf8');
    const room = run.max - run.sent;
    if (data.length > room) {
      run.truncated = true;
      data = data.subarray(0, Math.max(room, 0));
    }
    if (data.length === 0) return;
    run.sent += data.length;
    for (let off = 0; off < data.length; off += 256 << 10) frame(run.sock, { type, id: run.id }, data.subarray(off, off + (256 << 10)));
  }

  dispose() {
    if (this.server !== null) this.server.close();
    for (const c of this.conns) c.destroy();
    this.conns.clear();
    if (this.isolate !== null && !this.isolate.isDisposed) this.isolate.dispose();
  }

  async runWasm(sock, msg) {
    const entry = this.wasm;
    entry.count += 1;
    this.runs += 1;
    const t0 = process.hrtime.bigint();
    let r;
    // the sandbox's memory_mb covers its isolate and its Wasm store together: the store gets what
    // the isolate's heap leaves (runs of one sandbox take turns, so the heap is idle and read now)
    const heapMb = Math.ceil(this.readings().heap / (1 << 20));
    const capMb = Math.max(1, this.memoryMb - heapMb);
    const limitMs = 1000 * (msg.timeout_s > 0 ? Math.min(msg.timeout_s, MAX_RUN_S) : MAX_RUN_S);
    try {
      r = await wasmRun({ code: msg.code, timeout_s: msg.timeout_s, memory_mb: capMb, max_output: Math.max(0, msg.max_output) }, limitMs);
    } catch (e) {
      r = { error_name: 'WasmWorkerError', error_value: String(e.message || e), stdout: '', stderr: '' };
    }
    if (r.fatal) r = { error_name: 'WasmWorkerError', error_value: String(r.fatal), stdout: '', stderr: '' };
    const ms = Number(process.hrtime.bigint() - t0) / 1e6;
    this.busyMs += ms;
    if (r.oom) this.ooms += 1;
    sock.cork();
    for (const [type, text] of [['Stdout', r.stdout], ['Stderr', r.stderr]]) {
      const data = Buffer.from(String(text || ''), 'utf8');
      for (let off = 0; off < data.length; off += 256 << 10) frame(sock, { type, id: msg.id }, data.subarray(off, off + (256 << 10)));
    }
    if (typeof r.text === 'string') {
      frame(sock, { type: 'Display', id: msg.id, mime: 'text/plain', main: true, result: 0 }, Buffer.from(r.text, 'utf8'));
    }
    const name = String(r.error_name || '');
    frame(sock, {
      type: 'CodeDone', id: msg.id, error_name: bounded(name), error_value: bounded(r.error_value || ''),
      traceback: bounded(name ? `${name}: ${r.error_value || ''}` : ''), timed_out: Boolean(r.timed_out),
      truncated: Boolean(r.truncated), execution_count: entry.count, duration_ms: ms, oom_kills: r.oom ? 1 : 0,
    });
    sock.uncork();
  }

  async runCode(sock, msg) {
    if (msg.context === 'default-wasm') return this.runWasm(sock, msg);
    const entry = this.contexts.get(msg.context);
    if (entry === undefined) {
      const why = msg.context === 'default' ? 'language_unavailable' : 'context_not_found';
      return failure(sock, msg.id, why, msg.context === 'default'
        ? 'the isolate tier runs javascript (no python)' : `no code context ${msg.context}`);
    }
    entry.count += 1;
    this.runs += 1;
    const t0 = process.hrtime.bigint();
    const timeoutMs = Math.max(1, Math.round(1000 * (msg.timeout_s > 0 ? Math.min(msg.timeout_s, MAX_RUN_S) : MAX_RUN_S)));
    this.run = { sock, id: msg.id, sent: 0, max: Math.max(0, msg.max_output), truncated: false };
    let corked = false; // the result and CodeDone leave in one write: one wake-up of the engine
    let name = '', value = '', traceback = '', timedOut = false, oom = 0;
    const isolate = this.isolate;
    // the watchdog: a run isolated-vm's timer did not end is ended with its isolate
    const watchdog = setTimeout(() => {
      if (this.isolate === isolate && !isolate.isDisposed) {
        this.killed = true;
        isolate.dispose();
      }
    }, timeoutMs + WATCHDOG_MS);
    this.busy += 1;
    try {
      const ref = await entry.context.eval(msg.code, { timeout: timeoutMs, reference: true });
      try {
        if (ref.typeof !== 'undefined') {
          // copied and shown on the isolate's thread (a getter is user code: never on the host's)
          let text;
          try {
            text = util.inspect(await ref.copy());
          } catch (e) {
            if (this.killed || this.isolate.isDisposed) throw e;
            text = String(await entry.inspect.apply(undefined, [ref.derefInto()], { timeout: 1000 }));
          }
          sock.cork();
          corked = true;
          frame(sock, { type: 'Display', id: msg.id, mime: 'text/plain', main: true, result: 0 },
            Buffer.from(text, 'utf8').subarray(0, MAX_BODY));
        }
      } finally {
        ref.release();
      }
    } catch (e) {
      const elapsedMs = Number(process.hrtime.bigint() - t0) / 1e6;
      if (this.killed) { // the watchdog ended it
        timedOut = true;
        name = 'TimeoutError';
        value = `the run did not stop at its timeout; its isolate was disposed and a fresh one replaces it`;
        traceback = name + ': ' + value;
        this.busy -= 1;
        await this.fresh().catch((err) => process.stderr.write(`no fresh isolate for ${this.id}: ${err && err.message}\n`));
        this.busy += 1;
      } else if (this.isolate.isDisposed) { // the heap limit: isolated-vm disposed the isolate
        oom = 1;
        this.ooms += 1;
        name = 'MemoryLimitError';
        value = `the isolate passed its memory limit (${this.memoryMb} MiB) and was disposed; a fresh one replaces it`;
        traceback = name + ': ' + value;
        this.busy -= 1;
        await this.fresh().catch((err) => process.stderr.write(`no fresh isolate for ${this.id}: ${err && err.message}\n`));
        this.busy += 1;
      } else if (elapsedMs >= timeoutMs && /timed out/.test(String(e && e.message))) {
        timedOut = true;
      } else {
        name = String((e && e.name) || 'Error');
        value = String(e && e.message !== undefined ? e.message : e);
        // the frames of the isolate only: the host's side of the boundary is nobody's business
        traceback = String((e && e.stack) || `${name}: ${value}`).split('\n    at (<isolated-vm boundary>)')[0];
      }
    } finally {
      clearTimeout(watchdog);
      this.busy -= 1;
    }
    const ms = Number(process.hrtime.bigint() - t0) / 1e6;
    this.busyMs += ms;
    const run = this.run;
    this.run = null;
    frame(sock, {
      type: 'CodeDone', id: msg.id, error_name: bounded(name), error_value: bounded(value), traceback: bounded(traceback),
      timed_out: timedOut, truncated: run.truncated, execution_count: entry.count, duration_ms: ms, oom_kills: oom,
    });
    if (corked) sock.uncork();
  }

  handle(sock, msg) {
    switch (msg.type) {
      case 'Ping':
        return frame(sock, { type: 'Pong', id: msg.id, version: PROTOCOL_VERSION, pid: process.pid });
      case 'ContextRun':
        if (typeof msg.code !== 'string' || typeof msg.context !== 'string') return failure(sock, msg.id, 'invalid', 'bad ContextRun');
        this.chain = this.chain.then(() => this.runCode(sock, msg)).catch((e) => failure(sock, msg.id, 'internal', e));
        return undefined;
      case 'ContextCreate':
        if (msg.language === 'wasm') return failure(sock, msg.id, 'invalid', 'WebAssembly runs are stateless: run_code(module, language="wasm") runs each module in a fresh store');
        if (msg.language !== 'javascript') return failure(sock, msg.id, 'language_unavailable', `no ${msg.language} contexts on the isolate tier`);
        this.chain = this.chain.then(async () => {
          const name = await this.addContext(`js-${this.nextContext++}`);
          frame(sock, { type: 'ContextCreated', id: msg.id, context: name });
        }).catch((e) => failure(sock, msg.id, 'internal', e));
        return undefined;
      case 'ContextRunEnv': // an isolate has no process environment to set variables in
        return failure(sock, msg.id, 'invalid', 'the isolate tier has no environment variables: a run cannot set env_vars');
      case 'ContextList':
        for (const name of this.contexts.keys()) frame(sock, { type: 'ContextEntry', id: msg.id, context: name, language: 'javascript', cwd: '' });
        return frame(sock, { type: 'Ok', id: msg.id });
      case 'ContextRestart': {
        if (typeof msg.context !== 'string' || !this.contexts.has(msg.context)) {
          return failure(sock, msg.id, 'context_not_found', `no code context ${msg.context}`);
        }
        // after the runs already queued: a fresh context under the same name, the old one released
        this.chain = this.chain.then(async () => {
          const old = this.contexts.get(msg.context);
          if (old !== undefined) {
            old.inspect.release();
            old.context.release();
          }
          await this.addContext(msg.context);
          frame(sock, { type: 'Ok', id: msg.id });
        }).catch((e) => failure(sock, msg.id, 'internal', e));
        return undefined;
      }
      case 'ContextDelete': {
        const entry = this.contexts.get(msg.context);
        if (entry === undefined) return failure(sock, msg.id, 'context_not_found', `no code context ${msg.context}`);
        if (msg.context !== 'default-javascript') {
          this.contexts.delete(msg.context);
          entry.inspect.release();
          entry.context.release();
        }
        return frame(sock, { type: 'Ok', id: msg.id });
      }
      case 'Configure': {
        frame(sock, { type: 'UsageReport', id: msg.id, busy_ms: this.busyMs, runs: this.runs, uptime_ms: Date.now() - started });
        if (msg.reset_counts) {
          this.busyMs = 0;
          this.runs = 0;
          for (const entry of this.contexts.values()) entry.count = 0;
          this.wasm.count = 0;
        }
        return undefined;
      }
      case 'GetUsage':
        return frame(sock, { type: 'UsageReport', id: msg.id, busy_ms: this.busyMs, runs: this.runs, uptime_ms: Date.now() - started });
      case 'Reseed': // V8 seeds Math.random per isolate from the host's entropy: nothing to share
        return frame(sock, { type: 'Ok', id: msg.id });
      default:
        return failure(sock, msg.id, 'invalid', `${msg.type} is not available on the isolate tier (no commands, files or ports)`);
    }
  }

  serve(sock) {
    this.conns.add(sock);
    let buf = Buffer.alloc(0);
    sock.on('data', (chunk) => {
      buf = buf.length ? Buffer.concat([buf, chunk]) : chunk;
      while (buf.length >= 8) {
        const hlen = buf.readUInt32BE(0);
        const blen = buf.readUInt32BE(4);
        if (hlen > MAX_HEADER || blen > MAX_BODY) return sock.destroy();
        if (buf.length < 8 + hlen + blen) return undefined;
        let msg;
        try {
          msg = JSON.parse(buf.subarray(8, 8 + hlen).toString('utf8'));
        } catch (e) {
          return sock.destroy();
        }
        buf = buf.subarray(8 + hlen + blen);
        if (msg === null || typeof msg !== 'object' || typeof msg.type !== 'string' || !Number.isInteger(msg.id)) return sock.destroy();
        this.handle(sock, msg);
      }
      return undefined;
    });
    sock.on('error', () => sock.destroy());
    sock.on('close', () => this.conns.delete(sock));
  }
}

// ---------------------------------------------------------------- control

const sandboxes = new Map();

async function control(req, fd) {
  const id = typeof req.sandbox === 'string' ? req.sandbox : '';
  switch (req.op) {
    case 'add': {
      if (fd < 0 || !/^sb-[0-9a-f]{1,32}$/.test(id)) return { ok: false, error: 'add needs a sandbox id and its listening socket' };
      if (sandboxes.has(id)) return { ok: false, error: `sandbox ${id} exists` };
      if (sandboxes.size >= MAX_SANDBOXES) return { ok: false, error: `the isolate host holds its maximum of ${MAX_SANDBOXES} sandboxes` };
      const mb = Number(req.memory_mb);
      if (!Number.isInteger(mb) || mb < 8 || mb > 65536) return { ok: false, error: 'memory_mb must be an integer from 8 to 65536' };
      // admitted against the host's budget before anything is made: past it the host's cgroup
      // could be OOM-killed, with every isolate of the tenant in it
      const cost = mb + ISOLATE_OVERHEAD_MB;
      if (reservedMb + cost > BUDGET_MB) {
        return {
          ok: false, code: 'memory', reserved_mb: reservedMb, budget_mb: BUDGET_MB,
          maximum: Math.max(0, BUDGET_MB - reservedMb - ISOLATE_OVERHEAD_MB),
          error: `the tenant's isolates hold ${reservedMb} of their ${BUDGET_MB} MiB`,
        };
      }
      const sb = new Sandbox(id, mb);
      sandboxes.set(id, sb); // taken: a second add of the id is refused while this one runs
      reservedMb += cost;
      try {
        await sb.fresh();
      } catch (e) {
        if (sandboxes.get(id) === sb) {
          sandboxes.delete(id);
          reservedMb -= cost;
        }
        sb.dispose();
        return { ok: false, error: `no isolate: ${(e && e.message) || e}` };
      }
      if (sandboxes.get(id) !== sb) { // removed meanwhile
        sb.dispose();
        return { ok: false, error: `sandbox ${id} was removed while it was made` };
      }
      sb.server = net.createServer((sock) => sb.serve(sock));
      sb.server.on('error', () => {});
      sb.server.listen({ fd });
      return { ok: true, reserved_mb: reservedMb };
    }
    case 'remove': {
      const sb = sandboxes.get(id);
      if (sb !== undefined) {
        sandboxes.delete(id);
        reservedMb -= sb.memoryMb + ISOLATE_OVERHEAD_MB;
        sb.dispose();
      }
      return { ok: true, reserved_mb: reservedMb };
    }
    case 'has':
      return { ok: true, has: sandboxes.has(id) };
    case 'usage': {
      const sb = sandboxes.get(id);
      if (sb === undefined) return { ok: false, error: `no sandbox ${id}` };
      const { heap, cpu } = sb.readings();
      return { ok: true, memory_bytes: heap, cpu_ns: cpu, oom_kills: sb.ooms };
    }
    case 'stats':
      return {
        ok: true, sandboxes: sandboxes.size, rss: process.memoryUsage().rss, pid: process.pid,
        reserved_mb: reservedMb, budget_mb: BUDGET_MB, wasm_workers: liveWorkers,
      };
    default:
      return { ok: false, error: `unknown op ${req.op}` };
  }
}

// One control request: its line (and a sandbox's listening socket) read without blocking the
// loop: recvmsg only once the connection is readable, polled every millisecond up to
// CONTROL_TIMEOUT_MS (Node.js cannot receive an fd itself, and a blocking poll would stall every
// isolate's I/O meanwhile).
function receive(conn) {
  const deadline = Date.now() + CONTROL_TIMEOUT_MS;
  return new Promise((resolve, reject) => {
    const attempt = () => {
      if (conn.destroyed || conn._handle === null) return reject(new Error('the control connection closed'));
      try {
        return resolve(fdpass.recv(conn._handle.fd, 0));
      } catch (e) {
        if (String(e && e.message) !== 'timed out') return reject(e);
        if (Date.now() > deadline) return reject(new Error('no request within 2 s'));
        return setTimeout(attempt, 1);
      }
    };
    attempt();
  });
}

const server = net.createServer({ pauseOnConnect: true }, async (conn) => {
  conn.on('error', () => conn.destroy()); // EPIPE, ECONNRESET: that connection's end, never the host's
  let reply;
  let fd = -1;
  try {
    const [data, got] = await receive(conn);
    fd = got;
    reply = await control(JSON.parse(data.toString('utf8')), fd);
    if (reply.ok) fd = -1; // the sandbox's server owns it now
  } catch (e) {
    reply = { ok: false, error: String((e && e.message) || e) };
  }
  if (fd >= 0) {
    try {
      fs.closeSync(fd);
    } catch (e) {
      // gone already
    }
  }
  if (!conn.destroyed) conn.end(JSON.stringify(reply) + '\n');
});
server.on('error', () => {});

// the end: on SIGTERM (as the pid namespace's init, a signal without a handler is ignored), and
// once the home is deleted (fd 4: a file in it; a link count of 0 once it is removed)
for (const sig of ['SIGTERM', 'SIGINT', 'SIGHUP']) process.on(sig, () => process.exit(0));
setInterval(() => {
  let gone;
  try {
    gone = fs.fstatSync(ALIVE_FD).nlink === 0;
  } catch (e) {
    gone = true;
  }
  if (gone) process.exit(0);
}, 1000);

server.listen({ fd: 3 }, () => {
  process.stdout.write('isolate host listening\n');
  // one Wasm worker started now (Python + wasmtime: ~0.1 s), off the first Wasm run's path
  idleWorkers.push(newWorker());
});
