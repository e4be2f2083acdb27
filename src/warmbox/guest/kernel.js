// Code-context kernel for JavaScript: one long-lived Node.js whose globals survive between runs.
//
// The JavaScript twin of kernel.py, started by the agent as `node kernel.js <fd>` with a
// socketpair fd. It speaks the same frames (protocol.py: u32 header length, u32 body length,
// JSON header, raw body): receives ContextRun / Configure / Reseed, answers with Stdout, Stderr,
// Display and one CodeDone (or Ok). Top-level await works as in Node's REPL (its own transform);
// the value of the last expression is the main result, as util.inspect() text. SIGINT (sent on
// timeout) interrupts synchronous code and abandons a pending await.
'use strict';

const net = require('net');
const util = require('util');
const vm = require('vm');
const path = require('path');
const { createRequire } = require('module');

const MAX_BODY = 4 << 20;
const MAX_TEXT = 64 << 10;

let processTopLevelAwait = null;
try {
  // Node's REPL transform (needs --expose-internals): `const x = await f()` keeps `x` global
  processTopLevelAwait = require('internal/repl/await').processTopLevelAwait;
} catch (e) {
  processTopLevelAwait = null;
}

const sock = new net.Socket({ fd: Number(process.argv[2]), readable: true, writable: true });
let count = 0;
let run = null; // the cell running now: { id, sent, maxOutput, truncated, results }
let interrupt = null; // rejects the pending await of the running cell

function frame(header, body) {
  const head = Buffer.from(JSON.stringify(header), 'utf8');
  const data = body || Buffer.alloc(0);
  const prefix = Buffer.alloc(8);
  prefix.writeUInt32BE(head.length, 0);
  prefix.writeUInt32BE(data.length, 4);
  sock.write(Buffer.concat([prefix, head, data]));
}

function output(type, text) {
  if (run === null) return; // output after a cell ended (a timer): nobody to give it to
  let data = Buffer.from(String(text), 'utf8');
  const room = run.maxOutput - run.sent;
  if (data.length > room) {
    run.truncated = true;
    data = data.subarray(0, Math.max(room, 0));
  }
  if (data.length === 0) return;
  run.sent += data.length;
  for (let off = 0; off < data.length; off += 256 << 10) {
    frame({ type, id: run.id }, data.subarray(off, off + (256 << 10)));
  }
}

for (const [stream, type] of [[process.stdout, 'Stdout'], [process.stderr, 'Stderr']]) {
  stream.write = (chunk, encoding, callback) => {
    output(type, Buffer.isBuffer(chunk) ? chunk.toString('utf8') : chunk);
    if (typeof encoding === 'function') encoding();
    else if (typeof callback === 'function') callback();
    return true;
  };
}

function display(value, main) {
  if (run === null) return;
  const index = run.results++;
  const text = Buffer.from(util.inspect(value), 'utf8').subarray(0, MAX_BODY);
  frame({ type: 'Display', id: run.id, mime: 'text/plain', main, result: index }, text);
}

function bounded(text) {
  const s = String(text);
  return s.length > MAX_TEXT ? s.slice(0, MAX_TEXT) + '... [truncated]' : s;
}

globalThis.require = createRequire(path.join(process.cwd(), '[cell]'));
globalThis.display = (value) => display(value, false);

// Static imports at the start of a line become require() calls (a script cannot hold them):
// `import x from 'm'`, `import * as x from 'm'`, `import { a, b as c } from 'm'`, `import 'm'`.
const IMPORT = /^(\s*)import\s+(?:(\*\s+as\s+[\w$]+|[\w$]+|\{[^}]*\})(?:\s*,\s*(\{[^}]*\}|\*\s+as\s+[\w$]+))?\s+from\s+)?(['"][^'"]+['"])\s*;?/gm;

function bindings(clause, source) {
  if (clause.startsWith('{')) return `const ${clause.replace(/\s+as\s+/g, ': ')} = require(${source});`;
  if (clause.startsWith('*')) return `const ${clause.replace(/^\*\s+as\s+/, '')} = require(${source});`;
  return `const ${clause} = __wbDefault(require(${source}));`;
}

function rewriteImports(code) {
  return code.replace(IMPORT, (_, indent, first, second, source) => {
    if (!first) return `${indent}require(${source});`;
    return indent + bindings(first, source) + (second ? ' ' + bindings(second, source) : '');
  });
}

globalThis.__wbDefault = (m) => (m && m.__esModule && 'default' in m ? m.default : m);

async function evaluate(source, filename) {
  const code = rewriteImports(source);
  const wrapped = processTopLevelAwait ? processTopLevelAwait(code) : null;
  if (wrapped === null) {
    return new vm.Script(code, { filename }).runInThisContext({ breakOnSigint: true });
  }
  const pending = new vm.Script(wrapped, { filename }).runInThisContext({ breakOnSigint: true });
  const stopped = new Promise((_, reject) => {
    interrupt = reject;
  });
  const outcome = await Promise.race([pending, stopped]);
  return outcome ? outcome.value : undefined;
}

process.on('SIGINT', () => {
  if (interrupt !== null) {
    const e = new Error('Script execution interrupted.');
    e.name = 'Interrupted';
    interrupt(e);
  }
});

async function cell(msg) {
  count += 1;
  const start = process.hrtime.bigint();
  run = { id: msg.id, sent: 0, maxOutput: msg.max_output, truncated: false, results: 0 };
  let errorName = '';
  let errorValue = '';
  let traceback = '';
  try {
    const value = await evaluate(msg.code, `<cell ${count}>`);
    if (value !== undefined) {
      globalThis._ = value;
      display(value, true);
    }
  } catch (e) {
    if (e instanceof Error || (e && typeof e === 'object' && 'message' in e)) {
      errorName = String(e.name || (e.constructor && e.constructor.name) || 'Error');
      errorValue = String(e.message);
      traceback = String(e.stack || `${errorName}: ${errorValue}`);
    } else {
      errorName = 'Error';
      errorValue = util.inspect(e);
      traceback = `Uncaught ${errorValue}`;
    }
  }
  interrupt = null;
  const done = {
    type: 'CodeDone',
    id: msg.id,
    error_name: bounded(errorName),
    error_value: bounded(errorValue),
    traceback: bounded(traceback),
    timed_out: false,
    truncated: run.truncated,
    execution_count: count,
    duration_ms: Number(process.hrtime.bigint() - start) / 1e6,
    oom_kills: -1,
  };
  run = null;
  frame(done);
}

// An error a cell left behind (a rejected promise nobody awaited, a throwing timer) is reported
// on the running cell's stderr, never fatal to the kernel.
process.on('unhandledRejection', (reason) => output('Stderr', `Unhandled rejection: ${util.inspect(reason)}\n`));
process.on('uncaughtException', (e) => output('Stderr', `Uncaught ${util.inspect(e)}\n`));

let buffered = Buffer.alloc(0);
let queue = Promise.resolve();

function handle(header) {
  let msg;
  try {
    msg = JSON.parse(header.toString('utf8'));
  } catch (e) {
    process.exit(2);
  }
  if (msg.type === 'ContextRun') {
    queue = queue.then(() => cell(msg));
  } else if (msg.type === 'ContextRunEnv') {
    // the run's own variables; after it each is back as it was, unless the cell changed it
    queue = queue.then(async () => {
      const env = msg.env || {};
      const before = Object.keys(env).map((k) => [k, Object.prototype.hasOwnProperty.call(process.env, k) ? process.env[k] : undefined]);
      Object.assign(process.env, env);
      try {
        await cell(msg);
      } finally {
        for (const [k, old] of before) {
          if (process.env[k] !== env[k]) continue;
          if (old === undefined) delete process.env[k];
          else process.env[k] = old;
        }
      }
    });
  } else if (msg.type === 'Configure') {
    queue = queue.then(() => {
      Object.assign(process.env, msg.env || {});
      if (msg.reset_counts) count = 0;
      frame({ type: 'Ok', id: msg.id });
    });
  } else if (msg.type === 'Reseed') {
    queue = queue.then(() => frame({ type: 'Ok', id: msg.id })); // Math.random is per-process
  } else {
    process.exit(2); // outside the protocol: the agent sees the kernel die
  }
}

sock.on('data', (chunk) => {
  buffered = Buffer.concat([buffered, chunk]);
  while (buffered.length >= 8) {
    const headLen = buffered.readUInt32BE(0);
    const bodyLen = buffered.readUInt32BE(4);
    if (buffered.length < 8 + headLen + bodyLen) return;
    const header = buffered.subarray(8, 8 + headLen);
    buffered = buffered.subarray(8 + headLen + bodyLen);
    handle(header);
  }
});
sock.on('end', () => process.exit(0));
sock.on('error', () => process.exit(0));
