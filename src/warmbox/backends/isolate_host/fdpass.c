// recvmsg with one SCM_RIGHTS fd, for the isolate host (Node.js has no way to receive a file
// descriptor on a unix socket): recv(fd, timeoutMs) -> [Buffer data, received fd or -1]. The host
// calls it with timeoutMs 0 (never blocking its loop: "timed out" if nothing is there yet), and
// the read itself never waits either (MSG_DONTWAIT).
// Built with gcc against the host's Node.js headers (backends/isolate.py: install).
#include <errno.h>
#include <node_api.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAX_DATA 65536

static napi_value fail(napi_env env, const char *what) {
  napi_throw_error(env, NULL, what);
  return NULL;
}

static napi_value recv_fd(napi_env env, napi_callback_info info) {
  size_t argc = 2;
  napi_value argv[2];
  int32_t fd, timeout;
  if (napi_get_cb_info(env, info, &argc, argv, NULL, NULL) != napi_ok || argc != 2) return fail(env, "recv(fd, timeoutMs)");
  if (napi_get_value_int32(env, argv[0], &fd) != napi_ok || napi_get_value_int32(env, argv[1], &timeout) != napi_ok)
    return fail(env, "recv(fd, timeoutMs): integers");
  struct pollfd p = {.fd = fd, .events = POLLIN};
  int r;
  do r = poll(&p, 1, timeout); while (r < 0 && errno == EINTR);
  if (r <= 0) return fail(env, r == 0 ? "timed out" : strerror(errno));
  static char data[MAX_DATA];
  char control[CMSG_SPACE(sizeof(int))];
  struct iovec iov = {.iov_base = data, .iov_len = sizeof(data)};
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control, .msg_controllen = sizeof(control)};
  ssize_t n;
  do n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT); while (n < 0 && errno == EINTR);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return fail(env, "timed out");
  if (n < 0) return fail(env, strerror(errno));
  int got = -1;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c != NULL; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && c->cmsg_len == CMSG_LEN(sizeof(int))) {
      if (got >= 0) close(got);
      memcpy(&got, CMSG_DATA(c), sizeof(int));
    }
  }
  if (msg.msg_flags & MSG_CTRUNC) {  // more fds than one: none is kept
    if (got >= 0) close(got);
    return fail(env, "more than one file descriptor");
  }
  napi_value out, buf, fdv;
  void *dst;
  napi_create_buffer_copy(env, (size_t)n, data, &dst, &buf);
  napi_create_int32(env, got, &fdv);
  napi_create_array_with_length(env, 2, &out);
  napi_set_element(env, out, 0, buf);
  napi_set_element(env, out, 1, fdv);
  return out;
}

static napi_value init(napi_env env, napi_value exports) {
  napi_value fn;
  napi_create_function(env, "recv", NAPI_AUTO_LENGTH, recv_fd, NULL, &fn);
  napi_set_named_property(env, exports, "recv", fn);
  return exports;
}

NAPI_MODULE(NODE_GYP_MODULE_NAME, init)
