/* wb-restore: the microVM guest's one root helper, started by the initramfs before the agent.
 *
 * Every sandbox of a shape is restored from one memory snapshot, so each one would start with
 * the snapshot's kernel random-generator state (/dev/urandom, getrandom() and all built on them
 * -- ASLR, TLS keys, uuid4 -- repeating across tenants) and the snapshot's wall clock (days
 * behind for an old template: TLS certificates "not yet valid", wrong file times). After every
 * start the host's relay writes 64 bytes of host entropy to the virtio-serial port argv[1]; this
 * helper credits them to the input pool (RNDADDENTROPY), rekeys the crng at once (RNDRESEEDCRNG)
 * and answers 'R'. Only then -- the guest is running, so the time is fresh -- the relay sends
 * the host's CLOCK_REALTIME as two little-endian int64 (s, ns); the helper sets the clock
 * (clock_settime) and answers 'K'. All of this needs capabilities the agent does not have.
 * 'E' answers a step that was refused. Nothing else is read or written. Built static by the
 * image builder (gcc -static); no allocation, no stdio.
 */
#include <errno.h>
#include <fcntl.h>
#include <linux/random.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#define SEED 64
#define CLOCK 16

static struct {
    struct rand_pool_info info;
    unsigned char buf[SEED];
} req;

static unsigned char msg[SEED];

static void pause_10ms(void) {
    struct timespec ts = {0, 10 * 1000 * 1000};
    nanosleep(&ts, 0);
}

static int64_t le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return (int64_t)v;
}

static void answer(int port, char c) {
    while (write(port, &c, 1) < 0 && errno == EINTR)
        ;
}

int main(int argc, char **argv) {
    if (argc != 3)
        return 2;
    int port = open(argv[1], O_RDWR | O_CLOEXEC);
    int rnd = open(argv[2], O_RDWR | O_CLOEXEC);
    if (port < 0 || rnd < 0)
        return 1;
    size_t got = 0, want = SEED; /* SEED: entropy expected next; CLOCK: the time */
    for (;;) {
        struct pollfd p = {port, POLLIN, 0};
        if (poll(&p, 1, -1) < 0)
            continue;
        if ((p.revents & POLLHUP) && !(p.revents & POLLIN)) { /* no host connected: wait for one */
            got = 0, want = SEED;
            pause_10ms();
            continue;
        }
        ssize_t n = read(port, msg + got, want - got);
        if (n <= 0) {
            if (n < 0 && errno == EINTR)
                continue;
            got = 0, want = SEED;
            pause_10ms();
            continue;
        }
        got += (size_t)n;
        if (got < want)
            continue;
        got = 0;
        if (want == SEED) {
            memcpy(req.buf, msg, SEED);
            req.info.entropy_count = SEED * 8;
            req.info.buf_size = SEED;
            int ok = ioctl(rnd, RNDADDENTROPY, &req) == 0 && ioctl(rnd, RNDRESEEDCRNG) == 0;
            memset(req.buf, 0, SEED);
            memset(msg, 0, SEED);
            answer(port, ok ? 'R' : 'E');
            want = ok ? CLOCK : SEED;
        } else {
            struct timespec now = {(time_t)le64(msg), (long)le64(msg + 8)};
            int ok = now.tv_nsec >= 0 && now.tv_nsec < 1000000000L && clock_settime(CLOCK_REALTIME, &now) == 0;
            answer(port, ok ? 'K' : 'E');
            want = SEED;
        }
    }
}
