"""``warmbox doctor --security``: what warmbox withstands from hostile code, and the proof.

Each guarantee names the attack tests (``tests/attacks/``) that run the attack against real
sandboxes; ``tests/test_security_list.py`` fails when a named test is missing or an attack
test is named by no guarantee, so this list and that folder cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import json


@dataclasses.dataclass(frozen=True)
class Guarantee:
    area: str
    claim: str
    tiers: tuple[str, ...]
    tests: tuple[str, ...]  # "file.py::test_name" under tests/attacks/


_SHARED = ("container", "gvisor")
_ALL = ("container", "gvisor", "microvm")

GUARANTEES: tuple[Guarantee, ...] = (
    Guarantee(
        "tenants",
        "E2B's wire dialect is no way around the tenant walls: through its control plane (X-API-KEY), "
        "envd's Connect RPC and /files, the code interpreter and any other sandbox port (get_host, by "
        "Host or headers), another tenant's key finds none of a "
        "sandbox (404, absent from lists), and a sandbox access token opens only the sandbox it was "
        "issued for (an HMAC binds it to that id: another id, a forged or no token is 401); a signed "
        "file URL opens only the path, operation and time its owner's token signed.",
        _ALL,
        (
            "test_e2b_walls.py::test_another_tenants_key_gets_not_found_on_every_plane",
            "test_e2b_walls.py::test_a_sandbox_token_opens_only_its_own_sandbox",
            "test_e2b_walls.py::test_another_tenant_reaches_no_port_of_a_sandbox",
            "test_e2b_walls.py::test_a_signed_file_url_opens_only_what_it_was_signed_for",
        ),
    ),
    Guarantee(
        "tenants",
        "A sandbox's web servers (get_host's ports, by Host or E2B's headers, and the preview route) "
        "take WebSocket upgrades with the same checks as HTTP (another tenant's key: not found; another "
        "sandbox's token or none: refused), never see the caller's credentials or cookies, and get at "
        "most 1 MiB a message each way, in at most 1,024 frames (1009 beyond), and 64 sockets a sandbox "
        "at once (429 beyond). A page they serve runs "
        "no script on the API's origin, and on its own host (domain mode) only in an opaque origin: it "
        "can neither set cookies for the domain the API and console share nor send their SameSite cookies.",
        _ALL,
        (
            "test_e2b_walls.py::test_a_websocket_to_a_sandbox_port_is_relayed_with_the_http_checks_and_bounds",
            "test_e2b_walls.py::test_a_sandbox_page_never_runs_with_an_origin_that_reaches_the_api",
        ),
    ),
    Guarantee(
        "tenants",
        "A signed file URL of warmbox's own (files.sign_url: sb.files.download_url / upload_url) is a "
        "credential for one path, one sandbox, one operation and one tenant, until its expiry: used "
        "for another path, sandbox or operation, naming another tenant as signer, past its expiry "
        "(or with its expiry moved) or after its sandbox ended it is refused and writes nothing; "
        "another tenant's key gets no URL for a sandbox not its own (not found). The key signing it "
        "lives in the registry and is never sent to a tenant.",
        _ALL,
        ("test_e2b_walls.py::test_a_warmbox_signed_url_opens_only_what_it_was_signed_for",),
    ),
    Guarantee(
        "audit trail",
        "What a sandbox sends back cannot poison or inflate the command records: a cell's exception "
        "name is cut to 200 characters of [A-Za-z0-9_.:-], a NaN duration or a 70-bit exit code from "
        "the agent is stored as 0 / no exit code, and later records (and the sandbox's destroy) go on.",
        _SHARED,
        (
            "test_command_records.py::test_a_cells_exception_name_is_bounded_and_inert_in_the_records",
            "test_command_records.py::test_a_hostile_agents_numbers_cannot_block_the_records",
        ),
    ),
    Guarantee(
        "service",
        "A tenant's key cannot log the operator (or another tenant) out of the console: sessions are "
        "bounded per key (16; a key's own oldest go first), not only in total.",
        _ALL,
        ("test_console_sessions.py::test_a_tenant_cannot_log_the_operator_out",),
    ),
    Guarantee(
        "service",
        "One tenant cannot bury the approval queue: at most 32 of its create/resume questions wait at once "
        "(more are refused at once with ApprovalDenied), so another tenant's question stays on the operator's page.",
        _SHARED,
        ("test_approval_flood.py::test_a_tenant_cannot_bury_the_queue_in_its_own_questions",),
    ),
    Guarantee(
        "host memory",
        "A sandbox's command history cannot make its transcript export unbounded: an export holds at "
        "most transcript.MAX_COMMAND_TEXT (32 MiB) of command text, read a page at a time, and says it "
        "was truncated (100k 4 KiB cells were a 1.4 GB server process before).",
        _SHARED,
        ("test_export_bounds.py::test_many_large_commands_cannot_blow_up_an_export",),
    ),
    Guarantee(
        "host memory",
        "A code run's results are bounded on the host (count and bytes): a cell writing raw result "
        "frames to its kernel's socket gets a typed error, and the sandbox keeps working.",
        _SHARED,
        ("test_code_results.py::test_a_flood_of_empty_results_is_refused",),
    ),
    Guarantee(
        "service",
        "warmbox serve takes a caller's identity only from its key or, on the unix socket, its "
        "SO_PEERCRED uid: proxy headers never make a TCP caller a peer or root, and a key's admin "
        "right is never lent to another key of the same tenant.",
        _ALL,
        (
            "test_api_server.py::test_proxy_headers_do_not_make_a_tcp_caller_root",
            "test_api_server.py::test_a_plain_key_cannot_borrow_an_admin_keys_rights",
        ),
    ),
    Guarantee(
        "cluster",
        "A node's API takes the peer headers (X-Warmbox-Tenant, -Admin, -Key-Id) only with the cluster "
        "token (compared in constant time): a tenant's key, a guessed token, or any key on a server with "
        "no [cluster] token_file that sends them is refused (401), so no caller acts as another tenant, "
        "an admin, or the host's root through them.",
        _ALL,
        (
            "test_peer_auth.py::test_a_tenant_key_with_peer_headers_cannot_act_as_another_tenant_or_admin",
            "test_peer_auth.py::test_a_guessed_token_is_refused",
            "test_peer_auth.py::test_a_server_without_a_cluster_token_refuses_peer_headers",
        ),
    ),
    Guarantee(
        "service",
        "A client cannot hold a server connection by trickling a request head: it is closed once the head is overdue.",
        _ALL,
        ("test_api_server.py::test_a_trickled_header_does_not_hold_a_connection",),
    ),
    Guarantee(
        "service",
        "/metrics shows a tenant's key only its own tenant's series (no other tenant's, no host-wide ones); "
        "no sandbox id or command text ever becomes a label or a value (labels are closed sets).",
        _ALL,
        ("test_api_server.py::test_metrics_show_a_tenant_nothing_of_another_and_no_sandbox_data",),
    ),
    Guarantee(
        "service",
        "The approval queue: a tenant's key sees only its own tenant's questions, cannot answer another "
        "tenant's (not found, as an unknown id) nor approve its own start over budget (cost questions are "
        "an admin key's); each question is answered once, and a denied start leaves nothing behind.",
        _ALL,
        (
            "test_approval_queue.py::test_a_tenant_can_neither_lift_its_own_budget_nor_see_or_answer_"
            "another_tenants_questions",
        ),
    ),
    Guarantee(
        "host paths",
        "The host never writes, truncates or chowns through a path the sandbox controls: "
        "gVisor's /run trigger is a new inode made by directory fd (O_EXCL|O_NOFOLLOW, fchown of that fd), "
        "the agent is signalled, planted symlinks are unlinked, never followed.",
        ("gvisor",),
        (
            "test_host_paths.py::test_resume_trigger_never_follows_a_planted_symlink",
            "test_host_paths.py::test_restore_races_a_planted_resume_symlink",
        ),
    ),
    Guarantee(
        "host paths",
        "Memory-snapshot workspace trees are archived and unpacked by tar running as the "
        "directory's owner: symlinks (absolute too) round-trip as data, sparse files stay sparse.",
        ("gvisor",),
        ("test_host_paths.py::test_memory_snapshot_keeps_absolute_symlinks_and_sparse_files",),
    ),
    Guarantee(
        "host paths",
        "No host path reaches a tenant through the API: every route (walked from the server's own route "
        "table, MCP's tools and the console's pages included, with real sandboxes, a mounted volume, a "
        "snapshot and built templates, then with unknown and other tenants' ids and refused values) answers "
        "without the home, runtime or image directories, /var/lib/warmbox, a host temp directory or a host binary. "
        "A volume's record has no disk path, a template's build log is a name, LimitTooHigh names no "
        "directory, runtime logs and typed errors have the host's directories replaced by <home>, "
        "<runtime>, <images>, and a tenant's doctor and tier choice say <host path>.",
        _SHARED,
        (
            "test_api_host_paths.py::test_no_route_answers_a_host_path",
            "test_api_host_paths.py::test_the_walk_sees_what_the_server_answered_before",
        ),
    ),
    Guarantee(
        "service",
        "A string no UTF-8 can hold (a lone surrogate, a JSON \\ud800 escape) in any field of any operation "
        "is a 400 invalid_argument naming the field, where requests are decoded (and in the in-process "
        "front), before anything is looked up or claimed: no 500, no traceback, no pooled sandbox claimed "
        "and destroyed. Every string field of every operation (records, lists, dict keys) is fuzzed with "
        "it, a NUL and 100,000 characters over a real server: always a typed answer.",
        _ALL,
        (
            "test_api_hostile_strings.py::test_a_hostile_string_in_any_field_is_a_typed_answer",
            "test_api_hostile_strings.py::test_every_operation_with_a_string_is_fuzzed",
            "test_api_hostile_strings.py::test_the_in_process_front_refuses_before_claiming",
        ),
    ),
    Guarantee(
        "lost work",
        "WARMBOX_SNAPSHOT_MAX_BYTES bounds every tier's snapshot; a pause that cannot be "
        "stored after its checkpoint continues the sandbox from its own image.",
        ("gvisor",),
        ("test_host_paths.py::test_memory_snapshot_over_the_cap_is_refused_and_the_sandbox_continues",),
    ),
    Guarantee(
        "crashes",
        "A unix socket in a gVisor /workspace or writable volume (host directories: its checkpoint "
        "would panic) makes pause refuse up front; the sandbox keeps running.",
        ("gvisor",),
        (
            "test_host_paths.py::test_pause_with_a_socket_in_workspace_is_refused_and_the_sandbox_lives",
            "test_host_paths.py::test_pause_with_a_socket_in_a_volume_is_refused_and_the_sandbox_lives",
        ),
    ),
    Guarantee(
        "crashes",
        "files.read never buffers more than max_bytes on the host, refuses FIFOs, devices and "
        "sockets without blocking, and stops in the guest when the caller cancels, times out or leaves.",
        _ALL,
        (
            "test_files_read.py::test_symlink_to_dev_zero_is_refused_without_reading",
            "test_files_read.py::test_fifo_and_socket_are_refused_without_blocking",
            "test_files_read.py::test_large_file_is_refused_by_default_and_streams_in_bounded_memory",
            "test_files_read.py::test_slow_stream_reader_holds_a_window_and_an_abandoned_stream_stops",
            "test_files_read.py::test_timed_out_read_stops_in_the_sandbox",
            "test_files_read.py::test_reader_that_went_away_stops_the_agent",
            "test_files_read.py::test_file_longer_than_its_size_or_growing_fails_past_max_bytes",
            "test_files_read.py::test_bad_read_and_write_arguments_are_typed_errors",
            "test_files_read.py::test_a_hostile_agent_cannot_make_the_host_buffer",
            "test_microvm_attacks.py::test_microvm_files_read_is_bounded",
        ),
    ),
    Guarantee(
        "files",
        "Directory upload/download (tar streams) land inside their target: an absolute name, '..', "
        "a symlink or hardlink out, a device or FIFO is refused with UnsafeArchive — by the agent "
        "for uploads, by the host for downloads — and no path component is followed through a "
        "symlink, one planted by the sandbox user or left in the local directory included.",
        _SHARED,
        (
            "test_files_tar.py::test_crafted_tars_uploaded_into_the_sandbox_are_refused_and_land_nowhere",
            "test_files_tar.py::test_a_link_out_of_a_downloaded_directory_is_refused_on_the_host",
            "test_files_tar.py::test_crafted_tars_from_a_compromised_agent_are_refused_by_the_host_extractor",
        ),
    ),
    Guarantee(
        "files",
        "A downloaded symlink resolves inside the local directory even through other links (its '..' "
        "only leading: a chain like l -> ../.. then x -> a/b/l/../victim is refused), and the host's "
        "extractor holds bounded memory whatever the stream claims (extended headers at most 1 MiB, "
        "no sparse members, read members not kept); a time no file can have is no error.",
        ("container",),
        (
            "test_files_tar_bounds.py::test_a_symlink_chain_out_of_a_downloaded_directory_is_refused",
            "test_files_tar_bounds.py::test_a_crafted_download_stream_keeps_the_host_extractor_bounded",
        ),
    ),
    Guarantee(
        "crashes",
        "A 200 MB streamed files.write and files.read keep the host's memory small (the agent "
        "acknowledges what it wrote; the host sends one window beyond), in process and through "
        "warmbox serve (the raw body is streamed, never held).",
        ("container",),
        (
            "test_files_stream_memory.py::test_a_200mb_streamed_write_and_read_in_process_keep_host_memory_small",
            "test_files_stream_memory.py::"
            "test_a_200mb_streamed_write_and_read_over_http_keep_client_and_server_memory_small",
        ),
    ),
    Guarantee(
        "crashes",
        "A flood of file events under files.watch_dir with a slow callback waits in the sandbox "
        "(a window of acknowledged events; its kernel drops the excess), not in host memory, and "
        "stop() ends the watch at once.",
        ("container",),
        ("test_files_watch_flood.py::test_an_event_flood_with_a_slow_callback_keeps_host_memory_small",),
    ),
    Guarantee(
        "crashes",
        "Filling /tmp, /home/user and /dev/shm gets ENOSPC; the agent and the sandbox live.",
        _ALL,
        (
            "test_tmpfs_fill.py::test_full_tmpfs_mounts_get_enospc_and_the_sandbox_lives",
            "test_microvm_attacks.py::test_microvm_full_tmpfs_gets_enospc_and_the_vm_lives",
        ),
    ),
    Guarantee(
        "crashes",
        "Filling /workspace gets ENOSPC (files.write: NoSpace) at limits.disk_mb: the host's "
        "disk gives the sandbox no more; a pause/resume keeps the workspace and its quota, a snapshot that "
        "does not fit its new disk is NoSpace, and no mount or loop device outlives the sandbox, also when "
        "its creator was killed.",
        _ALL,
        (
            "test_disk_quota.py::test_filling_the_workspace_stops_at_its_quota_and_the_host_keeps_its_space",
            "test_disk_quota.py::test_microvm_workspace_is_a_disk_of_its_quota",
            "test_disk_quota.py::test_pause_and_resume_keep_the_workspace_and_its_quota",
            "test_disk_quota.py::test_a_snapshot_larger_than_its_new_disk_is_a_typed_error",
            "test_disk_quota.py::test_a_creator_killed_with_the_disk_mounted_leaves_nothing_once_reaped",
            "test_disk_quota.py::test_teardown_is_idempotent_removes_stacked_mounts_and_never_a_busy_one",
        ),
    ),
    Guarantee(
        "crashes",
        "mount, unshare, setuid and chroot from the sandbox user fail or stay in nested "
        "namespaces and never end the sandbox; a dead sandbox's runtime logs are kept (warmbox logs).",
        _SHARED,
        ("test_unprivileged_syscalls.py::test_privileged_calls_fail_or_stay_nested_and_the_sandbox_lives",),
    ),
    Guarantee(
        "lost work",
        "A snapshot or pause whose process is killed leaves no temp files once recovered, and "
        "a pause killed after its checkpoint ends paused and resumable.",
        _SHARED,
        (
            "test_killed_snapshots.py::test_killed_snapshot_leaves_no_temp_files",
            "test_killed_snapshots.py::test_pause_killed_after_its_checkpoint_ends_paused_and_resumable",
            "test_killed_snapshots.py::test_half_copied_memory_image_of_a_dead_process_is_removed",
        ),
    ),
    Guarantee(
        "crashes",
        "A timed-out command's processes all die: double-forked, setsid()ed, "
        "signal-ignoring and regrouped ones, a fork bomb, and what the cells of a killed code context "
        "started (the command's own cgroup on the container tier and the microVM, its own PID "
        "namespace on gVisor); "
        "what a command leaves running when it exits normally stays.",
        _SHARED,
        (
            "test_command_escape.py::test_timeout_kills_double_forked_setsid_and_signal_ignoring_processes",
            "test_command_escape.py::test_background_processes_of_a_normal_exit_keep_running",
            "test_command_escape.py::test_fork_bomb_ends_with_its_timeout",
            "test_command_escape.py::test_killed_code_context_takes_what_its_cells_started",
        ),
    ),
    Guarantee(
        "lost work",
        "Timeouts stay enforced after the daemon is SIGKILLed (its guard restarts it).",
        ("container",),
        ("test_daemon_death.py::test_timeout_enforced_after_the_daemon_is_sigkilled",),
    ),
    Guarantee(
        "lost work",
        "A template VM whose creator died is reaped; the next create of its shape works.",
        ("gvisor", "microvm"),
        (
            "test_template_creator_death.py::test_microvm_template_of_a_killed_creator_is_reaped",
            "test_template_creator_death.py::test_gvisor_pool_template_of_a_killed_daemon_is_reaped",
        ),
    ),
    Guarantee(
        "lost work",
        "A killed egress proxy is restarted with every policy, secret and CA, or network "
        "updates fail loudly; deny-all holds throughout.",
        ("container",),
        (
            "test_egress_proxy_death.py::test_killed_proxy_is_restarted_or_updates_fail_loudly",
            "test_egress_proxy_death.py::test_secrets_survive_a_proxy_restart",
            "test_egress_proxy_death.py::test_killed_supervisor_update_restarts_or_fails_loudly",
            "test_egress_proxy_death.py::test_proxy_that_cannot_restart_fails_updates_loudly",
            "test_egress_proxy_death.py::test_approvals_are_asked_again_after_a_restart",
        ),
    ),
    Guarantee(
        "isolation",
        "Two warmbox homes never run sandboxes as the same host uid (slots are host-wide).",
        _ALL,
        (
            "test_uid_slots.py::test_two_homes_never_share_a_uid_range",
            "test_uid_slots.py::test_concurrent_homes_get_distinct_slots",
            "test_uid_slots.py::test_a_full_ledger_is_a_typed_error_and_crashed_holders_are_reclaimed",
            "test_uid_slots.py::test_unreadable_holders_and_running_ranges_are_never_reclaimed",
            "test_uid_slots.py::test_sandboxes_from_before_the_ledger_are_adopted",
        ),
    ),
    Guarantee(
        "crashes",
        "A sandbox lives through its own limits.pids: a fork or clone past it gets EAGAIN (gVisor: the "
        "Sentry's own pids cgroup, while the host cgroup bounds the Sentry's threads and stubs apart, at "
        "512 + 32 per pid and at most a quarter of the host's), so pids=64 creates, pids=128 runs "
        "pipelines and a fork bomb held at the default 256 is killed with its command and the sandbox "
        "answers; the sandbox user cannot raise the limit or leave the cgroup. On gVisor's ptrace "
        "platform a bomb left running still grows the Sentry's host threads until that bound ends the "
        "sandbox (a shell bomb: after ~30 s here), never the host.",
        _SHARED,
        (
            "test_pids_limit.py::test_low_pids_limits_create_and_run_pipelines",
            "test_pids_limit.py::test_fork_bomb_gets_eagain_and_the_sandbox_lives",
            "test_pids_limit.py::test_shell_fork_bomb_at_the_default_limits",
            "test_pids_limit.py::test_the_sandbox_user_cannot_raise_or_leave_its_pids_cgroup",
        ),
    ),
    Guarantee(
        "crashes",
        "Background processes cannot take the agent down: output nobody reads stays in a bounded "
        "ring (32 MiB for all) and never blocks it; starting them until limits.pids is a typed "
        "error, and the sandbox still answers and recovers.",
        ("container",),
        (
            "test_background_processes.py::test_output_flood_with_no_reader_keeps_the_agent_bounded",
            "test_background_processes.py::test_background_processes_up_to_the_pids_limit",
        ),
    ),
    Guarantee(
        "host memory",
        "A background process's output followed by a slow reader (an NDJSON client that stops "
        "reading) holds at most 4 MiB on the host (16 MiB for all followers of a sandbox), the rest "
        "is dropped and reported as a lost event; a hostile agent flooding a directory watch past its "
        "window, or a follower with frames that are not output, gets a typed error and bounded host "
        "memory.",
        ("container",),
        (
            "test_host_stream_bounds.py::test_a_slow_follower_of_an_output_flood_keeps_the_host_bounded",
            "test_host_stream_bounds.py::test_a_hostile_agent_flooding_a_watch_or_a_follower_gets_a_typed_error",
        ),
    ),
    Guarantee(
        "isolation",
        "User code cannot read or write the guest agent's memory (/proc/1/mem, ptrace).",
        _ALL,
        (
            "test_agent_memory.py::test_user_code_cannot_touch_the_agents_memory",
            "test_microvm_attacks.py::test_microvm_user_code_cannot_touch_the_agents_memory",
        ),
    ),
    Guarantee(
        "isolation",
        "A Python code context forked from the guest agent (its memory shared copy-on-write) holds "
        "none of the agent's descriptors (host connections, the listener, the cgroup directory: each "
        "is /dev/null in it, its own socket alone stays), runs in its own cgroup, and cannot reach "
        "the agent's memory either.",
        _ALL,
        (
            "test_agent_memory.py::test_a_code_context_holds_nothing_of_the_agent",
            "test_microvm_attacks.py::test_microvm_code_context_holds_nothing_of_the_agent",
        ),
    ),
    Guarantee(
        "isolation",
        "Limits above the host's capacity or [limits] max_* are refused with LimitTooHigh "
        "before anything is created, on create, resume and fork.",
        _ALL,
        (
            "test_limits.py::test_absurd_limits_are_refused_naming_limit_value_maximum_and_source",
            "test_limits.py::test_defaults_come_from_the_host",
            "test_limits.py::test_tmpfs_is_bounded_by_the_sandboxs_memory",
            "test_limits.py::test_admin_maxima_from_the_file_and_the_environment_are_honoured",
            "test_limits.py::test_env_override_reaches_the_loaded_settings",
            "test_limits.py::test_bad_limits_settings_and_pools_above_them_are_config_errors",
            "test_limits.py::test_config_shows_the_limits_section",
            "test_limits.py::test_create_refuses_absurd_limits_before_anything_exists",
            "test_limits.py::test_a_config_max_is_honoured_and_normal_limits_still_create",
            "test_limits.py::test_resume_and_fork_refuse_limits_above_a_lowered_max",
            "test_disk_quota.py::test_disk_limits_are_checked_against_the_maximum_and_the_free_space",
        ),
    ),
    Guarantee(
        "egress",
        "A name no rule allows is never resolved upstream (no DNS exfiltration), also with CIDR "
        "rules and on_unknown='ask'; the question comes before any lookup.",
        ("container", "gvisor"),
        (
            "test_egress_dns.py::test_cidr_allow_rule_does_not_resolve_unknown_names",
            "test_egress_dns.py::test_cidr_rule_next_to_name_rules_resolves_allowed_names_only",
            "test_egress_dns.py::test_ask_is_answered_before_any_lookup",
        ),
    ),
    Guarantee(
        "egress",
        "A sandbox cannot smuggle a request past the egress proxy: llhttp reads every request strictly "
        "(Content-Length with Transfer-Encoding, two Content-Lengths, obs-fold, bare LF, a Transfer-Encoding "
        "other than chunked, a chunk size past 64 bits are a 400 and a closed connection, audited) and the "
        "upstream gets the proxy's own framing, so a lax server behind it never reads a second request, "
        "also inside a TLS tunnel the proxy intercepts to swap in a secret. "
        "Malformed DNS queries (truncated, looping compression, labels over 63 bytes, names over 255, "
        "counts the packet does not hold) are read by dnspython: FORMERR or dropped, audited, never sent "
        "upstream, and the resolver answers the next query.",
        ("container", "gvisor"),
        (
            "test_egress_smuggling.py::test_request_smuggling_through_the_proxy_is_refused",
            "test_egress_smuggling.py::test_request_smuggling_inside_an_intercepted_tunnel_is_refused",
            "test_egress_dns_malformed.py::test_malformed_queries_get_formerr_and_the_resolver_goes_on",
        ),
    ),
    Guarantee(
        "egress",
        "A sandbox cannot reach another name on an allowed host's address (a CDN's, routed by Host): plain "
        "HTTP goes upstream with the Host of the URL the policy decided on, and a request inside a tunnel "
        "whose secrets the proxy swaps in must be origin-form with one Host naming the tunnel's host and port "
        "(else 400 and a close; the secret never goes to another name).",
        ("container", "gvisor"),
        (
            "test_egress_smuggling.py::test_a_plain_requests_host_is_the_urls",
            "test_egress_smuggling.py::test_request_smuggling_inside_an_intercepted_tunnel_is_refused",
        ),
    ),
    Guarantee(
        "egress",
        "A sandbox dialling many names (on_unknown='ask') cannot flood the operator's approval queue: "
        "connections to one host:port share a question, a sandbox has at most 8 open (a tenant 64), the rest are "
        "denied at once (rule approval:queue-full, itemised in the audit log up to 100, then counted), "
        "nothing is resolved upstream, and its questions are withdrawn when it stops; a host name in a "
        "question is a checked name or IP literal, never free text (an IPv6 zone id is refused).",
        ("container",),
        ("test_egress_ask_flood.py::test_a_flood_of_names_cannot_flood_the_approval_queue",),
    ),
    Guarantee(
        "egress",
        "A microVM's NIC leads only into a network namespace of its own: root in the guest, with "
        "routes and addresses of its choosing, reaches nothing without a policy (not even the proxy), "
        "and with one only the gateway's proxy and DNS ports, as the sandbox's own link address.",
        ("microvm",),
        ("test_microvm_egress.py::test_microvm_guest_root_cannot_route_around_the_proxy",),
    ),
    Guarantee(
        "egress",
        "Every attempt around the proxy (raw IPs, other ports of the gateway, UDP) is refused at once "
        "and in network.log(), as the egress namespace saw it (a guest's own network stack or "
        "routes do not hide it).",
        _ALL,
        ("test_egress_audit.py::test_raw_ip_other_port_and_udp_attempts_are_refused_and_audited",),
    ),
    Guarantee(
        "egress",
        "A sandbox flooding raw-IP SYNs and datagrams is refused, and logged at a bounded rate into a "
        "bounded table and row count: the host's memory stays flat, its allowed sites keep working.",
        ("container",),
        ("test_egress_audit.py::test_raw_ip_syn_flood_is_refused_audited_with_a_bound_and_host_memory_stays_flat",),
    ),
    Guarantee(
        "egress",
        "Root in a gVisor sandbox, whose netstack gives it raw IP sockets on its link, gets no packet "
        "past the egress rules: nothing is routed beyond the gateway, and a packet carrying a "
        "neighbour's address (spoofed) is dropped before warmbox's resolver or proxy sees it.",
        ("gvisor",),
        ("test_egress_gvisor_raw.py::test_root_in_gvisor_cannot_get_raw_or_spoofed_packets_past_the_egress_rules",),
    ),
    Guarantee(
        "ports",
        "A port forward (get_host) is a way in only: while one is open and in use the sandbox still "
        "has no route out (not to the host, not anywhere); the agent dials only its own loopback.",
        _SHARED,
        ("test_port_forward.py::test_an_open_forward_gives_the_sandbox_no_way_out",),
    ),
    Guarantee(
        "ports",
        "A server in the sandbox behind the HTTP preview route cannot split the API's response (header "
        "lines with control characters are dropped), overflow it (a head over 64 KiB or no HTTP at all "
        "is a 502) or script the API's origin (every page carries Content-Security-Policy: sandbox).",
        ("container",),
        ("test_port_forward.py::test_a_hostile_server_cannot_split_or_script_the_preview",),
    ),
    Guarantee(
        "ports",
        "A server in the sandbox cannot desynchronise a kept-alive connection through the preview "
        "route: an interim (1xx) status is a 502, and a 204/304 (or a HEAD) is passed on without the "
        "bytes the server sent after its head; the next response on the connection is the real one.",
        ("container",),
        ("test_preview_framing.py::test_a_hostile_server_cannot_put_its_bytes_where_the_next_response_goes",),
    ),
    Guarantee(
        "ports",
        "A sandbox's server behind the preview route cannot set cookies on the API's origin (shared by "
        "every sandbox's preview) nor read the cookies a browser sends there: Set-Cookie is dropped on "
        "the way out and Cookie on the way in.",
        ("container",),
        ("test_preview_cookies.py::test_preview_passes_no_cookie_either_way",),
    ),
    Guarantee(
        "console",
        "What a sandbox produced (its command lines, the host names it asked the resolver or proxy "
        "for, its metadata) is shown by the operator's console as text: pages are rendered with "
        "autoescaping under a Content-Security-Policy with no inline script, so an injected "
        "<script> or onerror= attribute neither appears as markup nor could run. A tenant key's "
        "console session lists only its tenant's sandboxes, and another tenant's page is 'not found'.",
        ("container",),
        ("test_console_xss.py::test_sandbox_output_is_escaped_and_other_tenants_are_invisible",),
    ),
    Guarantee(
        "ports",
        "A connection storm on a forward holds at most MAX_CONNECTIONS tunnels (the rest are dropped at "
        "once) and they all close; an agent flooding past a tunnel's window, acknowledging bytes never "
        "sent, sending garbage or never answering gets a typed error, and the host's memory stays bounded; "
        "so does the API server's when a tunnel's client floods a sandbox server that never reads.",
        _ALL,
        (
            "test_port_forward.py::test_a_connection_storm_on_the_forward_is_bounded",
            "test_port_forward.py::test_a_hostile_agent_cannot_bloat_or_hang_the_host_through_a_tunnel",
            "test_port_forward.py::test_a_tunnel_client_flooding_a_server_that_never_reads_holds_bounded_server_memory",
        ),
    ),
    Guarantee(
        "files",
        "A named volume shared by sandboxes is no path to the host or another sandbox: the host never "
        "resolves a path inside it (links planted in it name nothing the host touches), another sandbox "
        "resolves them in its own root, the mount is nosuid/nodev, and a read-only mount cannot be made "
        "writable from inside (EROFS; a remount fails, also as the nested root).",
        _SHARED,
        ("test_volume_escape.py::test_links_planted_in_a_volume_reach_neither_the_host_nor_another_sandbox",),
    ),
    Guarantee(
        "isolation",
        "A sandbox of a template image writes only into its own upper layer: a tmpfs of its tmp_mb "
        "(ENOSPC there, never the host's disk); the image's shared layers stay unwritable and unchanged, "
        "and another sandbox of the image does not see the write.",
        ("container", "gvisor"),
        ("test_image_layers.py::test_a_sandbox_fills_only_its_own_bounded_layer",),
    ),
    Guarantee(
        "host paths",
        "Symlinks, a hardlink, a FIFO and a socket a template build's RUN step plants in its upper layer "
        "are stored as what they are (links never followed, FIFOs and sockets skipped unopened); a device "
        "node cannot be made.",
        ("container",),
        ("test_image_layers.py::test_planted_links_fifos_and_devices_in_a_build_layer_are_not_followed",),
    ),
    Guarantee(
        "crashes",
        "An image sandbox whose creator and daemon were SIGKILLed while it started leaves no overlay or "
        "tmpfs mount: the restarted daemon's recovery unmounts them.",
        ("container",),
        ("test_image_layers.py::test_a_killed_creator_and_daemon_leave_no_mount",),
    ),
    Guarantee(
        "host paths",
        "A template's layers on the host are root's alone: a setuid or setgid file a build's RUN step "
        "planted cannot be run by another host user as the layers' owner (LAYER_UID_BASE), and no host "
        "user reads a tenant's layer, nor the microVM root made of it; the image's sandboxes still read it "
        "(through their overlay; QEMU opens the root before it drops to the sandbox's uid), setuid "
        "powerless inside.",
        ("container", "gvisor", "microvm"),
        ("test_layer_host_access.py::test_a_setuid_file_planted_by_a_build_gives_host_users_nothing",),
    ),
    Guarantee(
        "host paths",
        "An OCI image layer whose members would land outside the layer ('..', an absolute name, a write "
        "through a symlink it planted) or that holds a device node is refused whole on import, and nothing "
        "of it stays in the layer store.",
        ("container", "gvisor"),
        ("test_hostile_images.py::test_an_image_layer_that_escapes_or_holds_a_device_is_refused",),
    ),
    Guarantee(
        "isolation",
        "What an image may hold gets its sandboxes nothing: an absolute symlink to a host file resolves "
        "inside the sandbox's own root, and a setuid-root binary of the image runs as the sandbox user.",
        ("container", "gvisor"),
        (
            "test_hostile_images.py::test_an_image_symlink_to_a_host_file_and_a_setuid_root_binary_give_the_sandbox_nothing",
        ),
    ),
    Guarantee(
        "files",
        "A template build's untrusted steps cannot steer the host: COPY lays its files out in a tree of "
        "the host's own and looks at the image's layers with directory fds that never follow a link (a "
        "COPY through a symlink a RUN step planted is refused; onto one, it replaces the link), the build "
        "context arrives as a tar unpacked by safetar (no member lands outside it), and a tenant cannot "
        "name a host path (from_oci) as its image. A RUN step writes into a bounded filesystem of its own "
        "(ENOSPC there, never the host's disk full).",
        ("container",),
        (
            "test_template_build.py::test_a_planted_symlink_does_not_steer_a_later_copy",
            "test_template_build.py::test_a_hostile_build_context_is_refused_before_any_sandbox",
            "test_template_build.py::test_a_tenant_cannot_build_from_a_host_path",
            "test_template_build.py::test_a_build_step_filling_its_disk_gets_enospc_not_the_hosts_disk",
        ),
    ),
    Guarantee(
        "tenants",
        "A template build step that runs code (RUN, apt, pip, npm) is reused only by the tenant that built "
        "it with the same build network: its cache key holds the owner (the in-process SDK is one owner of "
        "its own) and the allow list, and a tenant's step cache is its own registry rows. Another tenant "
        "building the same step text runs it itself and never reads the first one's output; a COPY of the "
        "same files (bytes, modes, mtimes) may share its layer, but is reported done, never cached, so "
        "progress and the image tell a tenant nothing of another's builds. A build network carrying "
        "secrets is refused, never dropped.",
        ("container",),
        (
            "test_template_step_cache.py::test_another_tenant_runs_the_same_step_itself_and_never_reads_its_output",
            "test_template_step_cache.py::test_a_copy_of_the_same_bytes_is_shared_but_reported_done_to_another_tenant",
            "test_template_step_cache.py::test_a_build_network_carrying_secrets_is_refused",
        ),
    ),
    Guarantee(
        "files",
        "A cluster node trusts no template layer it fetches from the shared object store: it reads at most "
        "a bound (the object's size first, then the stream), re-hashes the bytes against the digest the "
        "registry recorded and unpacks them as a hostile archive; a tampered, missing, oversized or "
        "escaping layer is refused (CorruptLayer / TemplateError) and nothing of it stays in the node's "
        "layer store. Object keys are made from validated digests only.",
        ("container", "gvisor", "microvm"),
        (
            "test_shared_layers.py::test_a_tampered_layer_in_the_object_store_is_refused_on_another_node",
            "test_shared_layers.py::test_a_layer_object_that_is_not_its_digest_is_refused_and_nothing_stays",
            "test_shared_layers.py::test_a_hostile_archive_stored_under_its_own_digest_is_refused",
            "test_shared_layers.py::test_layer_keys_are_digests_only",
        ),
    ),
    Guarantee(
        "isolates",
        "JavaScript in an isolate sees ECMAScript only: no require, process, fetch, Deno, Buffer, timers or "
        "module loader (import() is rejected), and the Function constructor reaches only its own isolate's "
        "global.",
        ("isolate",),
        ("test_isolate_escape.py::test_javascript_has_no_host_api_and_no_module_loader",),
    ),
    Guarantee(
        "limits",
        "An isolate's run is ended by the engine at its timeout (a tight loop, deep recursion, Atomics.wait) "
        "and keeps its state; a run past the memory limit (heap, strings, ArrayBuffers, Wasm memory) is "
        "oom_killed, its isolate replaced by a fresh one, and the host process and every other sandbox in "
        "it go on.",
        ("isolate",),
        (
            "test_isolate_escape.py::test_a_tight_loop_is_ended_by_the_engine_and_the_sandbox_keeps_its_state",
            "test_isolate_escape.py::test_huge_allocations_are_oom_killed_and_the_host_and_other_sandboxes_survive",
        ),
    ),
    Guarantee(
        "isolates",
        "A V8 escape lands in a jail: the isolate host process has no capabilities, a seccomp filter, "
        "no_new_privs, its own user (uid 1000 of a range of the host-wide uid ledger), pid, mount, network "
        "(loopback only), ipc, uts and cgroup namespaces, a memory-bounded cgroup, and a read-only root "
        "with no host files but /usr and the engine.",
        ("isolate",),
        ("test_isolate_escape.py::test_the_host_process_is_jailed",),
    ),
    Guarantee(
        "tenants",
        "Each tenant's isolates live in a host process of their own (the in-process SDK is a tenant of its "
        "own): its own cgroup with a memory bound and a CPU quota, and its own uid range from the host-wide "
        "uid ledger (two tenants or two homes never share a host uid).",
        ("isolate",),
        ("test_isolate_tenants.py::test_each_tenant_has_a_host_of_its_own_with_its_own_cgroup_and_ledger_uids",),
    ),
    Guarantee(
        "limits",
        "An isolate's memory_mb is admitted before it is made against its tenant's host budget (and the "
        "isolate tier's share of the machine): past it, LimitTooHigh at create, never an OOM of the host; "
        "a tenant filling its own isolate ends only that isolate, and another tenant's isolates go on.",
        ("isolate",),
        (
            "test_isolate_tenants.py::test_limits_past_a_tenants_host_are_refused_and_an_oom_stays_in_its_isolate",
            "test_isolate_tenants.py::test_the_isolates_of_every_tenant_together_stay_within_the_machines_share",
        ),
    ),
    Guarantee(
        "tenants",
        "A tenant spinning isolates (JavaScript and Wasm loops, a result whose getter spins) ends neither "
        "its own host nor another tenant's, and stalls another tenant's run by less than a second "
        "(measured: 14-49 ms median, 0.3 s at most); its spinning runs end at their timeout (a watchdog "
        "disposes an isolate its timer did not stop), and its own creates, Wasm jobs and metrics go on "
        "meanwhile.",
        ("isolate",),
        ("test_isolate_tenants.py::test_a_tenants_spinning_isolates_neither_end_nor_stall_another_tenants",),
    ),
    Guarantee(
        "tenants",
        "A tenant's isolate host that dies takes only that tenant's isolates, and they are marked lost at "
        "once (SandboxLost on the next call; the reaper's next tick for the others): a restarted host leaves "
        "no row claiming to be ready.",
        ("isolate",),
        ("test_isolate_tenants.py::test_a_killed_host_marks_its_tenants_sandboxes_lost_at_once_and_no_other",),
    ),
    Guarantee(
        "isolates",
        "An isolate host ends on SIGTERM, after a minute holding no isolate, and when its home is deleted; "
        "a host whose home is gone is swept with its cgroup and uid range by the next host start of any "
        "home.",
        ("isolate",),
        ("test_isolate_tenants.py::test_a_host_ends_on_sigterm_when_idle_and_when_its_home_is_deleted",),
    ),
    Guarantee(
        "isolates",
        "A WebAssembly run (wasmtime, in the same jail) has WASI without any preopened directory, is "
        "ended at its timeout (epoch interruption and fuel), and its memories are capped at the sandbox's "
        "memory_mb: a module past the cap is oom_killed, a grow past it fails, the host goes on.",
        ("isolate",),
        ("test_isolate_escape.py::test_wasm_has_no_files_and_is_bounded_in_time_and_memory",),
    ),
    Guarantee(
        "cluster",
        "A sandbox cannot reach another member of its cluster, whatever its egress policy (even "
        '"internet", even when the nodes have public addresses): the proxy refuses the hosts of every '
        "node's API in the registry, the Ray head and the registry's PostgreSQL host, as it refuses its own.",
        _SHARED,
        ("test_cluster_egress.py::test_a_sandbox_cannot_reach_another_cluster_node",),
    ),
    Guarantee(
        "cluster",
        "Someone who reaches a cluster's Ray ports cannot run code on its nodes nor read or change its "
        "membership: every Ray process warmbox starts (head, raylets) and its own clients use Ray's token "
        "authentication with the cluster's token file, and none starts without one (missing, readable by "
        "others, or owned by another user: a planted token is refused).",
        _SHARED,
        (
            "test_ray_auth.py::test_a_driver_without_the_token_cannot_run_code_on_the_cluster",
            "test_ray_auth.py::test_a_gcs_client_without_the_token_cannot_read_or_change_the_cluster",
            "test_ray_auth.py::test_ray_is_never_started_without_a_valid_token",
        ),
    ),
    Guarantee(
        "cluster",
        "A node marked down (late heartbeat, drain, Ray lost it) while its process still serves starts no "
        "sandbox: a create it receives is NodeFenced (503) with no row, no uid slot and no quota taken, so no "
        "sandbox is stranded on a down node where it would be neither lost nor reachable.",
        _SHARED,
        ("test_fenced_node.py::test_a_node_marked_down_starts_nothing",),
    ),
    Guarantee(
        "cluster",
        "A node stopped (SIGSTOP, a frozen host) while it holds a registry lock, such as a tenant's quota "
        "lock in the middle of a create, blocks the other nodes only until PostgreSQL ends its session "
        "([cluster] idle_timeout, 10 s): every registry connection has lock, statement and idle-transaction "
        "timeouts, and a write that timed out is retried within [cluster] retry_budget, then refused "
        "RegistryBusy (503) with nothing changed; the stopped node, woken, finds its transaction gone.",
        _SHARED,
        ("test_stopped_node.py::test_a_stopped_node_holding_a_tenants_lock_does_not_block_the_other_nodes",),
    ),
    Guarantee(
        "cluster",
        "One tenant's key cannot get a node marked down (and every tenant's sandboxes on it lost): the node's "
        "heartbeat beats from a thread of its own, so a burst of heavy requests holding its event loop (32 "
        "concurrent exports: 15-25 s) leaves the heartbeat's age at ~1 s, not past the monitor's 10 s.",
        _SHARED,
        ("test_node_heartbeat.py::test_a_tenants_burst_of_heavy_requests_does_not_stop_the_nodes_heartbeat",),
    ),
    Guarantee(
        "cluster",
        "A tenant cannot make the router scan every tenant's snapshots per request: a create from a snapshot "
        "(or a resume by snapshot name) reads one row by its key (100 such requests read 2,000,000 rows of a "
        "20k-snapshot table before, on the router's event loop shared by every caller).",
        _SHARED,
        ("test_router_snapshot_scan.py::test_a_create_from_an_unknown_snapshot_reads_one_row_not_the_table",),
    ),
    Guarantee(
        "cluster",
        "A tenant cannot go around the router to a node: a node's API refuses a tenant key (403 Forbidden, "
        "nothing made; admin keys and root on its socket are served) unless the operator sets [cluster] "
        "direct_access, and a forged peer header is refused (401). Either way the node holds creates to its "
        "own slots (NoCapacity, 503, nothing made), whatever the router's view or the caller.",
        _SHARED,
        (
            "test_node_access.py::test_a_tenant_key_at_a_node_is_refused",
            "test_node_access.py::test_a_node_holds_creates_to_its_slots",
            "test_node_access.py::test_with_direct_access_a_tenant_key_is_served_and_slots_still_hold",
        ),
    ),
    Guarantee(
        "cluster",
        "Traffic between a cluster's members is mutual TLS with the cluster's own CA: a node's API answers no "
        "plain-HTTP connection and no TLS one without a certificate of that CA, the router sends the token to "
        "no node whose certificate is not of it (nor to a plain http:// address), and Ray's gRPC (head, "
        "raylets, the router's GCS client) refuses a client holding the token but no certificate of the CA.",
        _SHARED,
        (
            "test_node_access.py::test_a_node_refuses_plaintext_and_callers_without_a_cluster_certificate",
            "test_node_access.py::test_the_router_refuses_a_node_that_is_not_of_the_cluster",
            "test_ray_auth.py::test_a_gcs_client_with_the_token_but_no_cluster_certificate_is_refused",
        ),
    ),
    Guarantee(
        "service",
        "A replayed step never runs twice: a create, command or code run with an idempotency key runs once per "
        "key; a client killed mid-command and replayed attaches to the same run (one process ran; a later "
        "replay gets the same recorded result), the HTTP transport's own retry of a dropped command carries "
        "its key, a replay after a server restart gets the recorded result, and one whose server died "
        "mid-command is OutcomeUnknown, never a second run. The same key with other arguments is a 409.",
        ("container",),
        (
            "test_idempotency.py::test_a_client_killed_mid_command_then_replayed_runs_it_once",
            "test_idempotency.py::test_the_http_transports_own_retry_of_a_dropped_command_runs_it_once",
            "test_idempotency.py::test_a_key_reused_with_other_arguments_is_a_conflict",
            "test_idempotency.py::test_replays_across_a_server_restart",
            "test_idempotency.py::test_e2b_create_with_an_idempotency_key_header",
            "test_idempotency.py::test_malformed_keys_and_misplaced_headers_are_refused_typed",
        ),
    ),
    Guarantee(
        "tenants",
        "Idempotency keys are a tenant's: another tenant using the same key string creates its own sandbox "
        "and never gets (or learns of) the first tenant's result.",
        ("container",),
        ("test_idempotency.py::test_two_tenants_using_one_key_string_do_not_collide",),
    ),
)


def print_guarantees(as_json: bool = False) -> int:
    if as_json:
        print(json.dumps([dataclasses.asdict(g) for g in GUARANTEES]))
        return 0
    for g in GUARANTEES:
        print(f"[{g.area}] {g.claim}")
        print(f"    tiers: {', '.join(g.tiers)}")
        for t in g.tests:
            print(f"    proof: tests/attacks/{t}")
    return 0
