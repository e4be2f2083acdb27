from warmbox.backends import seccomp


def test_profile_is_an_allowlist_without_escape_syscalls():
    prof = seccomp.profile()
    assert prof["defaultAction"] == "SCMP_ACT_ERRNO"
    allowed = set()
    for rule in prof["syscalls"]:
        if rule["action"] == "SCMP_ACT_ALLOW" and "args" not in rule:
            allowed |= set(rule["names"])
    assert not allowed & seccomp.DENIED
    assert {"ptrace", "pidfd_getfd", "process_vm_readv", "mount", "unshare", "bpf"} <= seccomp.DENIED
    assert not seccomp.ALLOWED & seccomp.DENIED
    # clone is allowed only without namespace flags, clone3 answers ENOSYS so libc falls back
    clone = next(r for r in prof["syscalls"] if r["names"] == ["clone"])
    assert clone["args"][0]["op"] == "SCMP_CMP_MASKED_EQ" and clone["args"][0]["value"] & 0x10000000
    clone3 = next(r for r in prof["syscalls"] if r["names"] == ["clone3"])
    assert clone3["action"] == "SCMP_ACT_ERRNO" and clone3["errnoRet"] == 38
    assert len(prof["architectures"]) <= 1  # native ABI only
