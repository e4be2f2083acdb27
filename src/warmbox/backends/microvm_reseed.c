/* wb-reseed: the microVM guest's one root helper, started by the initramfs before the agent.
 *
 * Every sandbox of a shape is restored from one memory snapshot, so every one of them starts
 * with the same kernel random-generator state: /dev/urandom, getrandom() and everything built
 * on them (ASLR, TLS keys, uuid4) would repeat across tenants. The host's relay writes 64
 * bytes of host entropy to the virtio-serial port argv[1] after every start; this helper adds
 * them to the input pool (RNDADDENTROPY, credited) and forces a new crng key at once
 * (RNDRESEEDCRNG; both need CAP_SYS_ADMIN, which the agent does not have), then answers one
 * byte: 'K' done, 'E' refused. Nothing else is read or written. Built static by the image
 * builder (gcc -static); no allocation, no libc stdio.
 */
#include <errno.h>
#include <fcntl.h>
#include <linux/random.h>
#include <poll.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#define SEED 64

static struct {
    struct rand_pool_info info;
    unsigned char buf[SEED];
} req;

static void pause_10ms(void) {
    struct timespec ts = {0, 10 * 1000 * 1000};
    nanosleep(&ts, 0);
}

int main(int argc, char **argv) {
    if (argc != 3)
        return 2;
    int port = open(argv[1], O_RDWR | O_CLOEXEC);
    int rnd = open(argv[2], O_RDWR | O_CLOEXEC);
    if (port < 0 || rnd < 0)
        return 1;
    size_t got = 0;
    for (;;) {
        struct pollfd p = {port, POLLIN, 0};
        if (poll(&p, 1, -1) < 0)
            continue;
        if ((p.revents & POLLHUP) && !(p.revents & POLLIN)) { /* no host connected: wait for one */
            got = 0;
            pause_10ms();
            continue;
        }
        ssize_t n = read(port, req.buf + got, SEED - got);
        if (n <= 0) {
            if (n < 0 && errno == EINTR)
                continue;
            got = 0;
            pause_10ms();
            continue;
        }
        got += (size_t)n;
        if (got < SEED)
            continue;
        got = 0;
        req.info.entropy_count = SEED * 8;
        req.info.buf_size = SEED;
        char answer = 'K';
        if (ioctl(rnd, RNDADDENTROPY, &req) != 0 || ioctl(rnd, RNDRESEEDCRNG) != 0)
            answer = 'E';
        memset(req.buf, 0, SEED);
        while (write(port, &answer, 1) < 0 && errno == EINTR)
            ;
    }
}
