# Sourced by scripts/test: makes sure the services the integration tests use are installed.
# Prometheus (and promtool) come from the Debian packages; installing needs root, so elsewhere
# this only says what is missing and the tests that need it are skipped.
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing prometheus (Debian package) for the deploy integration tests"
    # The package's own service is not wanted: the tests start their own Prometheus.
    if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; }; then
      echo "warning: could not install prometheus; the deploy tests that need it skip (and fail under CI)"
    fi
  else
    echo "note: prometheus/promtool not found; the deploy tests that need it skip (and fail under CI)"
  fi
fi
