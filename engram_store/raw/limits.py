"""The raw read channel's bounds and deadlines, in one place (see :mod:`._server`): the event loop and the
serving threads read them as ``limits.NAME`` when they act, so a deployment (or a test) may change them."""

#: How long a token handed out over ZeroMQ may wait for its connection, and how many may wait at once.
TOKEN_TTL_S = 60.0
MAX_TOKENS = 4096
#: A new connection must complete its first message (the hello, with --auth) within this: a client sends it as
#: soon as it connects, so only a stranger or a wedged client waits this long.
HELLO_TIMEOUT_S = 5.0
#: Any message must arrive whole within this of its first byte (a header and up to 64 MiB of ranges: 6 s at
#: 10 MB/s), however slowly it drips.
MESSAGE_TIMEOUT_S = 10.0
#: A connection with no request for this long since its last is closed (clients reconnect transparently); before
#: its first message, HELLO_TIMEOUT_S holds instead.
IDLE_TIMEOUT_S = 60.0
#: A reply must be taken by the client within SEND_TIMEOUT_S plus its size at SEND_MIN_BYTES_PER_S (a 256 MiB
#: reply: 26 s); a client that stops reading loses its connection, not a serving thread.
SEND_TIMEOUT_S = 10.0
SEND_MIN_BYTES_PER_S = 16 << 20
#: After a reply, a serving thread waits on the connection for its next request, LINGER_S watching it alone (a
#: client reading in a loop keeps a thread, as with a thread per connection; the Python path's blocking receive
#: times out after it too), then up to STICKY_S more, ready to give the thread up at once to a request that
#: waits for one; then the connection goes back to the event loop. A model step's lookups come tens of ms apart:
#: the thread that waits answers each in one kernel call, with no hand-off.
LINGER_S = 0.05
STICKY_S = 5.0
#: After a reply it answers in its kernel, a serving thread waits up to SETTLE_S for the next read (watching the
#: "thread wanted" pipe too) before it counts its reads in the metrics: at a model step's cadence that bookkeeping
#: then runs after the client has taken its reply instead of beside it, and back to back once every 64 reads.
#: It is no shorter than a kernel tick (4 ms at 250 Hz): a wait that ends before the next tick is the CPU's
#: earliest timer, and arming and cancelling that on every request reprograms the timer twice (two exits in a
#: virtual machine: 12 us more a read with the cores busy, measured with bench/bench_cadence.py).
SETTLE_S = 0.05
#: Connections held at once (at most half of what the open-files limit leaves the process's connections: see
#: engram_store._peers.LEDGER); past this a new one displaces the oldest that has not completed a message yet of the
#: peer holding the most such, else it is answered busy and the client reads over ZeroMQ.
MAX_CONNECTIONS = 4096
#: Connections one peer (an address, and the user for a connection from this host) may hold without a complete
#: message (past them its oldest goes); in all it may hold half the channel (past that its new one is answered busy).
PENDING_PER_PEER = 64
#: Threads that gather and send replies: the gather releases the GIL, so a few serve many clients.
SERVING_THREADS = 16
#: The scheduling slice a serving thread asks for (Linux 6.12+, see engram_store._sched; 0: the kernel's default):
#: woken by a read on a CPU another thread keeps busy, it preempts at once instead of waiting out that thread's
#: slice (with the default one, about 1% of reads waited a millisecond or more beside a NumPy model thread).
SERVING_SLICE_S = 100e-6
#: A serving thread with no request for this long drops its buffers.
SERVING_IDLE_S = 10.0
#: Bytes of request ranges in buffers of their own (ranges that come slowly, or past REQUEST_KEEP_BYTES) at once,
#: over all connections: four of the largest lookup rounds (2^20 ranges, 16 MiB), or one request of the most
#: ranges (64 MiB). Past it a read is answered busy.
BODY_BYTES_IN_FLIGHT = 64 << 20
#: A reply larger than this is sent in pieces of at most STREAM_PIECE_BYTES (a range of a piece's size or more
#: is a piece of its own, sent straight from the segment), gathered into two halves of a serving thread's
#: buffer, which therefore never exceeds this; the client receives one piece while the next is gathered.
STREAM_MIN_BYTES = 2 << 20
STREAM_PIECE_BYTES = STREAM_MIN_BYTES // 2
#: A serving thread receives a request's ranges into a buffer of its own (kept while it serves) up to this size
#: (65536 ranges: a full-size prefill lookup of one layer, reused without a page fault); larger ones, and ranges
#: the loop receives, get a buffer of their own, counted in flight. The buffer starts with room for SMALL_RANGES.
REQUEST_KEEP_BYTES = 1 << 20
SMALL_RANGES = 4096
#: Request buffers at least this large are mapped on their own, so their memory goes back to the system at once.
MMAP_MIN_BYTES = 256 << 10
#: How often the event loop looks for connections past a deadline.
SWEEP_S = 0.25
