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
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/random.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#ifndef BLKFLSBUF
#define BLKFLSBUF _IO(0x12, 97)
#endif

#define SEED 64
#define CLOCK 16
#define SLOTS 4
#define SLOT 256
#define MOUNTS (SLOTS * SLOT)

static struct {
    struct rand_pool_info info;
    unsigned char buf[SEED];
} req;

static unsigned char msg[MOUNTS];

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

/* The mount point of a slot's path: an fd of the directory, walked without following links. */
static int mount_point(const char *path) {
    char part[SLOT];
    int fd = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    const char *p = path;
    if (fd < 0 || *p != '/')
        return -1;
    while (*p) {
        while (*p == '/')
            p++;
        if (!*p)
            break;
        size_t n = 0;
        while (p[n] && p[n] != '/')
            n++;
        if (n >= sizeof(part) || (n == 1 && p[0] == '.') || (n == 2 && p[0] == '.' && p[1] == '.')) {
            close(fd);
            return -1;
        }
        memcpy(part, p, n);
        part[n] = 0;
        p += n;
        int next = openat(fd, part, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (next < 0 && errno == ENOENT && mkdirat(fd, part, 0755) == 0)
            next = openat(fd, part, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        close(fd);
        if (next < 0)
            return -1;
        fd = next;
    }
    return fd;
}

/* "/dev/vdX" of the disk whose virtio-blk serial is "wbvol<slot>", in dev[]; 0 if there is none. */
static int slot_disk(int slot, char *dev, size_t size) {
    char want[8] = "wbvol0", got[16], name[64];
    want[5] = (char)('0' + slot);
    DIR *d = opendir("/sys/block");
    if (!d)
        return 0;
    struct dirent *e;
    int found = 0;
    while (!found && (e = readdir(d)) != 0) {
        if (strncmp(e->d_name, "vd", 2) != 0 || strlen(e->d_name) > 16)
            continue;
        memcpy(name, "/sys/block/", 11);
        strcpy(name + 11, e->d_name);
        strcat(name, "/serial");
        int fd = open(name, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            continue;
        ssize_t n = read(fd, got, sizeof(got) - 1);
        close(fd);
        if (n < 6)
            continue;
        got[n] = 0;
        if (got[n - 1] == '\n')
            got[n - 1] = 0;
        if (strcmp(got, want) == 0 && strlen(e->d_name) + 6 < size) {
            memcpy(dev, "/dev/", 5);
            strcpy(dev + 5, e->d_name);
            found = 1;
        }
    }
    closedir(d);
    return found;
}

static char mount_slot(int slot, const unsigned char *rec) {
    if (rec[0] == 0)
        return '-';
    char path[SLOT], dev[32], target[40];
    memcpy(path, rec + 1, SLOT - 1);
    path[SLOT - 1] = 0;
    if (!slot_disk(slot, dev, sizeof(dev)))
        return 'D';
    /* the slot's disk was an empty placeholder when this memory was saved: its cached blocks
       (the boot's partition scan) are not the volume's */
    int bd = open(dev, O_RDONLY | O_CLOEXEC);
    if (bd < 0)
        return 'D';
    int flushed = ioctl(bd, BLKFLSBUF, 0) == 0;
    close(bd);
    if (!flushed)
        return 'F';
    int fd = mount_point(path);
    if (fd < 0)
        return 'P';
    strcpy(target, "/proc/self/fd/");
    int at = 14, v = fd, digits = 1;
    while (v >= 10)
        v /= 10, digits++;
    for (int i = digits - 1, x = fd; i >= 0; i--, x /= 10)
        target[at + i] = (char)('0' + x % 10);
    target[at + digits] = 0;
    unsigned long flags = MS_NOSUID | MS_NODEV | MS_NOATIME | (rec[0] == 2 ? MS_RDONLY : 0);
    int ok = mount(dev, target, "ext4", flags, 0) == 0;
    close(fd);
    return ok ? 'M' : 'F';
}

int main(int argc, char **argv) {
    if (argc != 4)
        return 2;
    int port = open(argv[1], O_RDWR | O_CLOEXEC);
    int rnd = open(argv[2], O_RDWR | O_CLOEXEC);
    if (port < 0 || rnd < 0 || chroot(argv[3]) != 0 || chdir("/") != 0)
        return 1;
    size_t got = 0, want = SEED; /* SEED: entropy expected next; CLOCK: the time; MOUNTS: volumes */
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
        } else if (want == CLOCK) {
            struct timespec now = {(time_t)le64(msg), (long)le64(msg + 8)};
            int ok = now.tv_nsec >= 0 && now.tv_nsec < 1000000000L && clock_settime(CLOCK_REALTIME, &now) == 0;
            answer(port, ok ? 'K' : 'E');
            want = ok ? MOUNTS : SEED;
        } else {
            char res[SLOTS];
            for (int i = 0; i < SLOTS; i++)
                res[i] = mount_slot(i, msg + i * SLOT);
            while (write(port, res, SLOTS) < 0 && errno == EINTR)
                ;
            want = SEED;
        }
    }
}
