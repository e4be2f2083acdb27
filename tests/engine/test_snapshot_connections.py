"""The connections a memory pause refuses on a tier whose checkpoint cannot save them (no sandbox)."""

from __future__ import annotations

from warmbox.engine.checkpoint import open_connections


def test_open_connections_reads_a_guests_proc_net_tcp():
    """What a pause on a tier whose checkpoint cannot save connections refuses (runsc 2022): every
    connected or handshake endpoint off loopback, in either table; loopback, listeners, closed ones
    and lines that do not parse (the guest wrote them) pass."""
    tcp = (
        b"  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        b"   6: 811CEF0A:D5DD 0100EF0A:0C38 01 00000000:00000000 00:00000000 00000000  1000        0        7 1\n"
        b"   7: 811CEF0A:D5DE 0100EF0A:0C38 06 00000000:00000000 00:00000000 00000000  1000        0        8 1\n"
        b"   8: 0100007F:1E61 0100007F:51C7 01 00000000:00000000 00:00000000 00000000  1000        0        9 1\n"
        b"   9: 00000000:1E61 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0       10 1\n"
        b"  10: 811CEF0A:D5DF 0100EF0A:0C38 07 00000000:00000000 00:00000000 00000000  1000        0       11 1\n"
        b"  11: ZZZZ:1 0100EF0A:0C38 01\n  12: 811CEF0A\n\xff\xfe garbage\n"
    )
    assert open_connections(tcp, v6=False) == [
        "10.239.28.129:54749 -> 10.239.0.1:3128 (ESTABLISHED)",
        "10.239.28.129:54750 -> 10.239.0.1:3128 (TIME_WAIT)",
    ]
    tcp6 = (
        b"  sl  local_address                         remote_address                        st\n"
        # ::ffff:127.0.0.1 to itself (loopback), then 2001:db8::5 to 2001:db8::1 port 443 (SYN_SENT)
        b"   0: 0000000000000000FFFF00000100007F:1F90 0000000000000000FFFF00000100007F:D000 01\n"
        b"   1: B80D0120000000000000000005000000:C000 B80D0120000000000000000001000000:01BB 02\n"
        b"   2: 00000000000000000000000001000000:0050 00000000000000000000000001000000:C001 01\n"
    )
    assert open_connections(tcp6, v6=True) == ["[2001:db8::5]:49152 -> [2001:db8::1]:443 (SYN_SENT)"]
    assert open_connections(b"", v6=False) == [] and open_connections(tcp6, v6=False) == []
