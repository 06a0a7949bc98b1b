// A stand-in for PyTorch's MemoryViz.js in the page torch.cuda._memory_viz writes (the real
// one is loaded from a CDN, out of reach here): the same entry point, add_local_files(files,
// view), reads the snapshot the way the viewer does and reports what it found in
// <pre id="viewer-probe">, with the allocated bytes over the history drawn as an SVG line.
//
// * base64, then a pickle reader that knows only the opcodes the viewer's own unpickler knows
//   (protocols 2 to 4), so a snapshot it reads is one the viewer reads;
// * the history walked back from the final segments and blocks to before its first event, as
//   the viewer's segment view does (an alloc must remove a live block, a segment_alloc an
//   existing segment, ...): a full history must end on an empty device.

function decode(b64) {
  const text = atob(b64);
  const out = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) out[i] = text.charCodeAt(i);
  return out;
}

function unpickle(bytes) {
  const view = new DataView(bytes.buffer);
  const utf8 = new TextDecoder();
  const stack = [], marks = [], memo = [];
  let pos = 0;
  const u8 = () => bytes[pos++];
  const u32 = () => { const v = view.getUint32(pos, true); pos += 4; return v; };
  const popMark = () => { const m = marks.pop(); return stack.splice(m, stack.length - m); };
  for (;;) {
    const op = String.fromCharCode(u8());
    switch (op) {
      case '\x80': { const p = u8(); if (p < 2 || p > 4) throw new Error(`protocol ${p}`); break; }
      case '\x95': pos += 8; break;                       // FRAME
      case '.': return stack.pop();                       // STOP
      case '(': marks.push(stack.length); break;          // MARK
      case '\x94': memo.push(stack[stack.length - 1]); break;  // MEMOIZE
      case 'q': memo[u8()] = stack[stack.length - 1]; break;   // BINPUT
      case 'r': memo[u32()] = stack[stack.length - 1]; break;  // LONG_BINPUT
      case 'h': stack.push(memo[u8()]); break;                 // BINGET
      case 'j': stack.push(memo[u32()]); break;                // LONG_BINGET
      case '}': stack.push({}); break;
      case 'd': { const items = popMark(); const d = {};
        for (let i = 0; i < items.length; i += 2) d[items[i]] = items[i + 1];
        stack.push(d); break; }
      case 's': { const v = stack.pop(), k = stack.pop(); stack[stack.length - 1][k] = v; break; }
      case 'u': { const items = popMark(); const d = stack[stack.length - 1];
        for (let i = 0; i < items.length; i += 2) d[items[i]] = items[i + 1];
        break; }
      case ']': stack.push([]); break;
      case 'l': stack.push(popMark()); break;
      case 'a': { const v = stack.pop(); stack[stack.length - 1].push(v); break; }
      case 'e': { const items = popMark(); stack[stack.length - 1].push(...items); break; }
      case ')': stack.push([]); break;
      case 't': stack.push(popMark()); break;
      case '\x85': stack.push([stack.pop()]); break;
      case '\x86': stack.push(stack.splice(-2, 2)); break;
      case '\x87': stack.push(stack.splice(-3, 3)); break;
      case 'N': stack.push(null); break;
      case '\x88': stack.push(true); break;
      case '\x89': stack.push(false); break;
      case 'J': stack.push(view.getInt32(pos, true)); pos += 4; break;
      case 'K': stack.push(u8()); break;
      case 'M': stack.push(view.getUint16(pos, true)); pos += 2; break;
      case '\x8a': { const n = u8(); let v = 0n;                // LONG1
        for (let i = n - 1; i >= 0; i--) v = (v << 8n) | BigInt(bytes[pos + i]);
        if (n && bytes[pos + n - 1] >= 128) v -= 1n << BigInt(8 * n);
        pos += n; stack.push(Number(v)); break; }
      case 'G': stack.push(view.getFloat64(pos, false)); pos += 8; break;
      case '\x8c': { const n = u8(); stack.push(utf8.decode(bytes.subarray(pos, pos + n)));
        pos += n; break; }
      case 'X': { const n = u32(); stack.push(utf8.decode(bytes.subarray(pos, pos + n)));
        pos += n; break; }
      default: throw new Error(`opcode 0x${op.charCodeAt(0).toString(16)} at ${pos - 1}`);
    }
  }
}

function walkBack(snapshot, device, errors) {
  const blocks = new Set();
  const segments = new Map();  // address -> size
  let reserved = 0;
  for (const seg of snapshot.segments) {
    if (seg.device !== device) continue;
    segments.set(seg.address, seg.total_size);
    reserved += seg.total_size;
    let addr = seg.address;
    for (const b of seg.blocks) {
      if (b.state === 'active_allocated') blocks.add(addr);
      addr += b.size;
    }
  }
  const events = snapshot.device_traces[device] || [];
  for (let i = events.length - 1; i >= 0; i--) {
    const e = events[i];
    switch (e.action) {
      case 'alloc': if (!blocks.delete(e.addr)) errors.push(`event ${i}: alloc of no block`); break;
      case 'free_completed':
        if (blocks.has(e.addr)) errors.push(`event ${i}: freed block still live`);
        blocks.add(e.addr); break;
      case 'segment_alloc':
        if (segments.get(e.addr) !== e.size) errors.push(`event ${i}: no such segment`);
        segments.delete(e.addr); reserved -= e.size; break;
      case 'segment_free': segments.set(e.addr, e.size); reserved += e.size; break;
      case 'segment_map': reserved -= e.size; break;
      case 'segment_unmap': reserved += e.size; break;
      default: break;
    }
  }
  return {start_blocks: blocks.size, start_reserved: reserved};
}

function draw(events) {
  let now = 0, peak = 0;
  const points = [];
  events.forEach((e, i) => {
    if (e.action === 'alloc') now += e.size;
    if (e.action === 'free_completed') now -= e.size;
    peak = Math.max(peak, now);
    points.push([i, now]);
  });
  const w = 1000, h = 400;
  const svg = document.createElementNS('http://www.w3.org/2000/svg', 'svg');
  svg.setAttribute('width', w); svg.setAttribute('height', h);
  const line = document.createElementNS('http://www.w3.org/2000/svg', 'polyline');
  line.setAttribute('points', points.map(([i, v]) =>
    `${(i / Math.max(1, events.length - 1)) * w},${h - (v / Math.max(1, peak)) * (h - 10)}`)
    .join(' '));
  line.setAttribute('fill', 'none'); line.setAttribute('stroke', '#4e79a7');
  line.setAttribute('stroke-width', '3');
  svg.appendChild(line);
  document.body.appendChild(svg);
  return peak;
}

export function add_local_files(files, view) {
  const out = {view, errors: []};
  try {
    const snapshot = unpickle(decode(files[0].base64));
    const device = 0;
    out.num_segments = snapshot.segments.length;
    out.num_events = (snapshot.device_traces[device] || []).length;
    out.categories = [...new Set((snapshot.device_traces[device] || [])
      .filter(e => 'category' in e).map(e => e.category))].sort();
    Object.assign(out, walkBack(snapshot, device, out.errors));
    out.peak_allocated = draw(snapshot.device_traces[device] || []);
  } catch (err) {
    out.errors.push(String(err));
  }
  const pre = document.createElement('pre');
  pre.id = 'viewer-probe';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
}
