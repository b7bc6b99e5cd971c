"""Write the demo dataset (reverse short strings): python scripts/make_demo_data.py [OUT_DIR]"""
import sys

from swiftlite.demo import write_demo_data

if __name__ == "__main__":
    train, val = write_demo_data(sys.argv[1] if len(sys.argv) > 1 else "demo_data")
    print(f"wrote {train} and {val}")
