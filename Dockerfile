# One image for every Python service of docker-compose.yml (migrate, worker, beat, flower, demo);
# each service picks its process with `command:`.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Only what `pip install .[flower]` needs (README.md is the package's readme in pyproject.toml);
# the flower extra because the compose stack's flower service runs from this image.
# The sources are removed after installing so the processes import the installed package,
# package data (sql/) included, and never a stray copy in the working directory.
COPY pyproject.toml README.md /tmp/src/
COPY outbox_dispatch/ /tmp/src/outbox_dispatch/
RUN pip install "/tmp/src[flower]" && rm -rf /tmp/src

# Celery warns when run as root and there is no reason to: run as an unprivileged user.
RUN useradd --create-home --uid 10001 --user-group outbox
USER outbox
WORKDIR /home/outbox

CMD ["outbox-dispatch", "--help"]
