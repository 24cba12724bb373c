from services.rld.service import RelayDecoder
from shared.service import service_main

if __name__ == "__main__":
    service_main(RelayDecoder, "rld")
