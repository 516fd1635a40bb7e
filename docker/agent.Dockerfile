# The remote receiver of the wide-area trials: the kickass-agent Debian package
# (`make agent-deb`: the agent, its dependencies and the prebuilt Kick-Ass
# receiver ka-agent-recv) installed on Debian, as on a receiver host. Built
# from the repository root after `make agent-deb`:
#   docker build -f docker/agent.Dockerfile -t kickass-agent .
# No toolchain in the image and none needed to build it.
FROM debian:bookworm-slim
LABEL org.kickass.image="kickass-agent"
# The package's Python (its Depends) and `ip` for the environment record, in
# a layer of their own: a new package rebuilds only the layer below.
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        python3.11 iproute2 >/dev/null \
    && rm -rf /var/lib/apt/lists/*
COPY build/agent/kickass-agent_*_amd64.deb /tmp/
# The postinst checks that ka-agent-recv runs with CAP_NET_RAW only (as a
# build's default capabilities allow) and makes a secret: not the image's, so
# it goes; the container gets its own (KICKASS_AGENT_SECRET).
RUN DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        /tmp/kickass-agent_*_amd64.deb >/dev/null \
    && rm -f /tmp/kickass-agent_*_amd64.deb /etc/kickass-agent/secret
ENV PYTHONUNBUFFERED=1
# Control API, TCP flows, Kick-Ass flows (informative under host networking).
EXPOSE 8700/tcp 8701/tcp 8702/udp
ENTRYPOINT ["/opt/kickass-agent/bin/kickass-agent"]
CMD ["--config", "/etc/kickass-agent/agent.toml", "--state-dir", "/var/lib/kickass-agent"]
