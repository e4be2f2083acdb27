"""The seccomp profile of the container tiers: an allowlist at least as strict as Docker's default.

Default action is EPERM. Compared with Docker's default profile this one additionally denies
ptrace, process_vm_readv/writev, kcmp, chroot, the NUMA-policy calls and AF_VSOCK sockets, and
filters only the host's native architecture (no 32-bit syscall ABI at all). Namespace creation
through clone() is refused by an argument filter; clone3 answers ENOSYS so libc falls back to
the filtered clone().
"""

from __future__ import annotations

import platform

ALLOWED = frozenset(
    """
accept accept4 access alarm arch_prctl bind brk capget capset chdir chmod chown clock_getres
clock_gettime clock_nanosleep close close_range connect copy_file_range creat dup dup2 dup3
epoll_create epoll_create1 epoll_ctl epoll_pwait epoll_pwait2 epoll_wait eventfd eventfd2 execve
execveat exit exit_group faccessat faccessat2 fadvise64 fallocate fchdir fchmod fchmodat fchown
fchownat fcntl fdatasync fgetxattr flistxattr flock fork fremovexattr fsetxattr fstat fstatfs
fsync ftruncate futex futex_waitv futimesat getcpu getcwd getdents getdents64 getegid geteuid
getgid getgroups getitimer getpeername getpgid getpgrp getpid getppid getpriority getrandom
getresgid getresuid getrlimit get_robust_list getrusage getsid getsockname getsockopt
get_thread_area gettid gettimeofday getuid getxattr inotify_add_watch inotify_init
inotify_init1 inotify_rm_watch io_cancel ioctl io_destroy io_getevents io_pgetevents ioprio_get
ioprio_set io_setup io_submit kill lchown lgetxattr link linkat listen listxattr llistxattr
lremovexattr lseek lsetxattr lstat madvise membarrier memfd_create mincore mkdir mkdirat mknod
mknodat mlock mlock2 mlockall mmap modify_ldt mprotect mq_getsetattr mq_notify mq_open
mq_timedreceive mq_timedsend mq_unlink mremap msgctl msgget msgrcv msgsnd msync munlock
munlockall munmap nanosleep newfstatat open openat openat2 pause pidfd_open
pidfd_send_signal pipe pipe2 pkey_alloc pkey_free pkey_mprotect poll ppoll prctl pread64 preadv
preadv2 prlimit64 pselect6 pwrite64 pwritev pwritev2 read readahead readlink readlinkat readv
recvfrom recvmmsg recvmsg remap_file_pages removexattr rename renameat renameat2
restart_syscall rmdir rseq rt_sigaction rt_sigpending rt_sigprocmask rt_sigqueueinfo
rt_sigreturn rt_sigsuspend rt_sigtimedwait rt_tgsigqueueinfo sched_getaffinity sched_getattr
sched_getparam sched_get_priority_max sched_get_priority_min sched_getscheduler
sched_rr_get_interval sched_setaffinity sched_setattr sched_setparam sched_setscheduler
sched_yield seccomp select semctl semget semop semtimedop sendfile sendmmsg sendmsg sendto
setfsgid setfsuid setgid setgroups setitimer setpgid setpriority setregid setresgid setresuid
setreuid setrlimit set_robust_list setsid setsockopt set_thread_area set_tid_address setuid
setxattr shmat shmctl shmdt shmget shutdown sigaltstack signalfd signalfd4 socketpair splice stat
statfs statx symlink symlinkat sync sync_file_range syncfs sysinfo tee tgkill time timer_create
timer_delete timer_getoverrun timer_gettime timer_settime timerfd_create timerfd_gettime
timerfd_settime times tkill truncate umask uname unlink unlinkat utime utimensat utimes vfork
vmsplice wait4 waitid write writev
""".split()
)

# Never allowed, whatever else changes: the calls container escapes and kernel attacks use.
DENIED = frozenset(
    """
mount umount umount2 pivot_root chroot unshare setns open_tree move_mount fsopen fsconfig fsmount
fspick mount_setattr keyctl add_key request_key bpf perf_event_open userfaultfd kexec_load
kexec_file_load init_module finit_module delete_module create_module reboot swapon swapoff acct
settimeofday stime clock_settime clock_adjtime adjtimex syslog quotactl quotactl_fd
lookup_dcookie vm86 vm86old open_by_handle_at name_to_handle_at io_uring_setup io_uring_enter
io_uring_register iopl ioperm ptrace process_vm_readv process_vm_writev kcmp sethostname
setdomainname fanotify_init mbind set_mempolicy get_mempolicy migrate_pages move_pages
nfsservctl uselib ustat sysfs _sysctl pidfd_getfd
""".split()
)

# clone() without any CLONE_NEW* flag: NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET
CLONE_NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
AF_VSOCK = 40
ENOSYS = 38
EPERM = 1
# personality(): only the values Docker allows (PER_LINUX, PER_LINUX32, UNAME26 variants, query)
PERSONALITY_ALLOWED = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)

_ARCH = {"x86_64": "SCMP_ARCH_X86_64", "aarch64": "SCMP_ARCH_AARCH64"}


def profile() -> dict:
    """OCI ``linux.seccomp`` object for this host's architecture."""
    machine = platform.machine()
    arch = _ARCH.get(machine)
    syscalls: list[dict] = [
        {"names": sorted(ALLOWED), "action": "SCMP_ACT_ALLOW"},
        {
            "names": ["clone"],
            "action": "SCMP_ACT_ALLOW",
            "args": [{"index": 0, "value": CLONE_NAMESPACE_FLAGS, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}],
        },
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},
        {
            "names": ["socket"],
            "action": "SCMP_ACT_ALLOW",
            "args": [{"index": 0, "value": AF_VSOCK, "op": "SCMP_CMP_NE"}],
        },
    ]
    for value in PERSONALITY_ALLOWED:
        syscalls.append(
            {
                "names": ["personality"],
                "action": "SCMP_ACT_ALLOW",
                "args": [{"index": 0, "value": value, "op": "SCMP_CMP_EQ"}],
            }
        )
    return {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": EPERM,
        "architectures": [arch] if arch else [],
        "syscalls": syscalls,
    }
